//! An idle shared-memory session costs about no CPU: after the spin budget both sides sleep
//! on the futex. Alone in its test binary, so that no other test's threads are counted.

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

#[test]
fn an_idle_shm_session_sleeps() {
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
