//! Server placement (on unless `REMORA_SERVE_AVOID_PEER_CPU=0`): a thread that finds itself
//! on the CPU its peer said leaves that one CPU out of the mask it had first, and moves; one
//! CPU is left out at a time. One test in this binary: the variable is read once per process,
//! and here it is left unset (the default).

use rustix::thread::{CpuSet, sched_getaffinity, sched_setaffinity};

#[test]
fn a_thread_on_its_peers_cpu_leaves_that_cpu_and_only_that_one() {
    // SAFETY: removed before this binary's only test reads it, its one reader: the default.
    unsafe { std::env::remove_var("REMORA_SERVE_AVOID_PEER_CPU") };
    assert!(remora_shm::avoid_peer_cpu(), "on by default");
    assert!(
        remora_shm::say_cpu(),
        "a client must say its CPU for the server to avoid it"
    );
    // In a thread of its own, so the test harness's thread keeps its mask.
    std::thread::spawn(|| {
        let first = sched_getaffinity(None).expect("sched_getaffinity");
        if first.count() < 2 {
            println!("skipped: this thread may run on one CPU only (nothing to move to)");
            // ...and on that one it stays.
            let here = remora_shm::current_cpu();
            assert!(!remora_shm::avoid_cpu(Some(here)));
            return;
        }
        // Not on the peer's CPU, or no CPU said: nothing to do.
        assert!(!remora_shm::avoid_cpu(None));
        let here = remora_shm::current_cpu();
        let elsewhere = (0..CpuSet::MAX_CPU as u32)
            .find(|&c| c != here && first.is_set(c as usize))
            .unwrap();
        assert!(!remora_shm::avoid_cpu(Some(elsewhere)));
        assert_eq!(sched_getaffinity(None).unwrap(), first);

        // On it: moved, the mask is the first one less that CPU.
        assert!(remora_shm::avoid_cpu(Some(here)));
        let mut less = first;
        less.unset(here as usize);
        assert_eq!(sched_getaffinity(None).unwrap(), less);
        assert_ne!(
            remora_shm::current_cpu(),
            here,
            "the kernel moves a thread off a CPU it left"
        );

        // Met again elsewhere: that CPU is left out instead, the first one allowed again.
        let now = remora_shm::current_cpu();
        assert!(remora_shm::avoid_cpu(Some(now)));
        let mut less = first;
        less.unset(now as usize);
        assert_eq!(sched_getaffinity(None).unwrap(), less);
        assert!(less.is_set(here as usize));
        sched_setaffinity(None, &first).unwrap();
    })
    .join()
    .unwrap();
}
