//! CPU time of a process tree from `/proc`, in nanoseconds, for the benchmarks: each task's
//! `schedstat` (time on a CPU, in ns; `/proc/PID/stat` counts in 10 ms ticks, too coarse for
//! a loop of 20 ms). A tree is the root processes and every process whose parent is in it.

use std::time::{Duration, Instant};

/// The CPU time so far of `roots` and all their descendants (0 for what cannot be read: a
/// process gone, a kernel without `schedstat`).
pub(crate) fn tree_cpu_ns(roots: &[u32]) -> u64 {
    tree(roots).iter().map(|&pid| process_cpu_ns(pid)).sum()
}

/// Waits, at most `limit`, until the tree used less than `quiet` of CPU time over 10 ms
/// (a server's warm worker starting its driver, say, has finished); answers whether it did.
pub(crate) fn settle(roots: &[u32], quiet: Duration, limit: Duration) -> bool {
    let until = Instant::now() + limit;
    let mut last = tree_cpu_ns(roots);
    loop {
        std::thread::sleep(Duration::from_millis(10));
        let now = tree_cpu_ns(roots);
        if now.saturating_sub(last) < quiet.as_nanos() as u64 {
            return true;
        }
        if Instant::now() >= until {
            return false;
        }
        last = now;
    }
}

/// `roots` and their descendants, from every `/proc/PID/stat`'s parent field.
fn tree(roots: &[u32]) -> Vec<u32> {
    let mut parents = Vec::new();
    if let Ok(dir) = std::fs::read_dir("/proc") {
        for e in dir.flatten() {
            let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
                continue;
            };
            if let Some(ppid) = std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|s| parent_of(&s))
            {
                parents.push((pid, ppid));
            }
        }
    }
    let mut tree: Vec<u32> = roots.to_vec();
    let mut i = 0;
    while i < tree.len() {
        let p = tree[i];
        for &(pid, ppid) in &parents {
            if ppid == p && !tree.contains(&pid) {
                tree.push(pid);
            }
        }
        i += 1;
    }
    tree
}

/// The parent pid of a `/proc/PID/stat` line: the second field after the command, which
/// is in parentheses and may itself hold spaces and parentheses.
fn parent_of(stat: &str) -> Option<u32> {
    let after = &stat[stat.rfind(')')? + 1..];
    after.split_whitespace().nth(1)?.parse().ok()
}

/// Sum of the first `schedstat` field of every task of `pid`.
fn process_cpu_ns(pid: u32) -> u64 {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return 0;
    };
    tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_parent_is_read_past_an_odd_command_name() {
        assert_eq!(parent_of("42 (a) b (c)) S 7 42 42 0"), Some(7));
        assert_eq!(parent_of("42 (remora) R 1 42"), Some(1));
        assert_eq!(parent_of("garbage"), None);
    }

    #[test]
    fn a_tree_counts_its_children_and_grows_with_their_work() {
        let me = std::process::id();
        let mut busy = std::process::Command::new("sh")
            .args(["-c", "while :; do :; done"])
            .spawn()
            .unwrap();
        let mut idle = std::process::Command::new("sleep")
            .arg("5")
            .spawn()
            .unwrap();
        assert!(tree(&[me]).contains(&busy.id()));
        let before = tree_cpu_ns(&[busy.id()]);
        std::thread::sleep(Duration::from_millis(100));
        let after = tree_cpu_ns(&[busy.id()]);
        assert!(after > before, "{before} -> {after}");
        // A busy tree does not settle; an idle one does.
        assert!(!settle(
            &[busy.id()],
            Duration::from_millis(1),
            Duration::from_millis(60)
        ));
        assert!(settle(
            &[idle.id()],
            Duration::from_millis(1),
            Duration::from_secs(1)
        ));
        for c in [&mut busy, &mut idle] {
            let _ = c.kill();
            let _ = c.wait();
        }
        assert_eq!(tree_cpu_ns(&[u32::MAX]), 0);
    }
}
