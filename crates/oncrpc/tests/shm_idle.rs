//! An idle shared-memory session costs about no CPU: after the spin budget both sides sleep
//! on the futex; 16 busy sessions on one server all make progress, and go back to sleep when
//! idle. In a test binary of their own, so that no other test's threads are counted, and one
//! at a time.

mod common;

use std::time::Duration;

use common::*;

/// CPU time (user + system, in clock ticks) of this process's threads whose name starts
/// with `prefix`, and of the whole process.
fn cpu_ticks(prefix: &str) -> (u64, u64) {
    let fields = |stat: &str| -> Option<(String, u64)> {
        let open = stat.find('(')?;
        let close = stat.rfind(')')?;
        let name = stat[open + 1..close].to_owned();
        let rest: Vec<&str> = stat[close + 2..].split(' ').collect();
        // Fields 14 and 15 (utime, stime) are at 11 and 12 after the name.
        let t = rest.get(11)?.parse::<u64>().ok()? + rest.get(12)?.parse::<u64>().ok()?;
        Some((name, t))
    };
    let mut threads = 0;
    for entry in std::fs::read_dir("/proc/self/task").unwrap() {
        let path = entry.unwrap().path().join("stat");
        if let Ok(stat) = std::fs::read_to_string(path)
            && let Some((name, t)) = fields(&stat)
            && name.starts_with(prefix)
        {
            threads += t;
        }
    }
    let (_, all) = fields(&std::fs::read_to_string("/proc/self/stat").unwrap()).unwrap();
    (threads, all)
}

/// The tests measure CPU time: one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn an_idle_shm_session_sleeps() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = start(Transport::Shm);
    let c = s.client().unwrap();
    for _ in 0..1000 {
        c.call(PROG, 1, NULLPROC, None, |_| Ok(()), |_| Ok(()))
            .unwrap();
    }
    // Let the spin budget run out.
    std::thread::sleep(Duration::from_millis(200));
    let (conn0, all0) = cpu_ticks("oncrpc-conn");
    std::thread::sleep(Duration::from_secs(1));
    let (conn1, all1) = cpu_ticks("oncrpc-conn");
    // 100 ticks a second: a spinning thread would show about 100.
    assert!(
        conn1 - conn0 <= 3,
        "server thread used {} ticks",
        conn1 - conn0
    );
    assert!(all1 - all0 <= 5, "the process used {} ticks", all1 - all0);
    // And the session still works.
    c.call(PROG, 1, NULLPROC, None, |_| Ok(()), |_| Ok(()))
        .unwrap();
}

#[test]
fn sixteen_sessions_all_progress_then_sleep() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = start(Transport::Shm);
    let clients: Vec<_> = (0..16).map(|_| s.client().unwrap()).collect();
    let start_at = std::time::Instant::now();
    let threads: Vec<_> = clients
        .iter()
        .cloned()
        .map(|c| {
            std::thread::spawn(move || {
                let t = std::time::Instant::now();
                for _ in 0..2000 {
                    c.call(PROG, 1, NULLPROC, None, |_| Ok(()), |_| Ok(()))
                        .unwrap();
                }
                t.elapsed()
            })
        })
        .collect();
    let took: Vec<Duration> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    // Every session finished its calls (none starved by spinning neighbours) in bounded time,
    // on however few cores the machine has.
    assert!(
        start_at.elapsed() < Duration::from_secs(120),
        "16 sessions took {:?}",
        start_at.elapsed()
    );
    let slowest = took.iter().max().unwrap();
    assert!(*slowest < Duration::from_secs(120), "{took:?}");
    // Idle again (clients still connected): nobody spins.
    std::thread::sleep(Duration::from_millis(300));
    let (conn0, _) = cpu_ticks("oncrpc-conn");
    std::thread::sleep(Duration::from_secs(1));
    let (conn1, _) = cpu_ticks("oncrpc-conn");
    assert!(
        conn1 - conn0 <= 10,
        "16 idle server threads used {} ticks in a second",
        conn1 - conn0
    );
    for c in &clients {
        c.call(PROG, 1, NULLPROC, None, |_| Ok(()), |_| Ok(()))
            .unwrap();
    }
}

#[test]
fn a_launch_and_synchronize_loop_leaves_the_batch_flusher_parked() {
    // A launch + synchronize loop over shared memory, as the shim makes it: the launch
    // (one-way) right after the previous synchronize's signal (one-way, written at once)
    // and its completion word (`note_waited`). A one-way call after a wait is written at
    // once, so nothing waits in the batch, and the flusher thread parks instead of looking
    // at the queue every 50 µs (a fifth of a core before).
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = start(Transport::Shm);
    let c = s
        .client_with(remora_oncrpc::ClientConfig {
            oneway_batch_delay: Some(Duration::from_micros(50)),
            ..remora_oncrpc::ClientConfig::default()
        })
        .unwrap();
    let round = |n: u32| {
        for i in 0..n {
            // The synchronize's signal, then its completion word seen.
            c.call_oneway_raw(
                PROG,
                1,
                ONEWAY_PUSH,
                |e| {
                    e.put_u32(i);
                    Ok(())
                },
                &[],
            )
            .unwrap();
            c.note_waited();
            // The next launch.
            c.call_oneway(PROG, 1, ONEWAY_PUSH, |e| {
                e.put_u32(i);
                Ok(())
            })
            .unwrap();
            if i % 50 == 0 {
                c.call(PROG, 1, NULLPROC, None, |_| Ok(()), |_| Ok(()))
                    .unwrap();
            }
        }
    };
    round(2000);
    let (batch0, _) = cpu_ticks("oncrpc-batch");
    let start = std::time::Instant::now();
    while start.elapsed() < Duration::from_secs(1) {
        round(500);
    }
    let (batch1, _) = cpu_ticks("oncrpc-batch");
    assert!(
        batch1 - batch0 <= 3,
        "the batch flusher used {} ticks in a second",
        batch1 - batch0
    );
    // What was pushed arrived, in order, around the calls.
    let log = c
        .call(
            PROG,
            1,
            GET_LOG,
            None,
            |_| Ok(()),
            |d| {
                let n = d.get_u32()?;
                (0..n).map(|_| d.get_u32()).collect::<Result<Vec<_>, _>>()
            },
        )
        .unwrap();
    assert!(log.len() >= 5000, "{}", log.len());
}
