//! CPU time of a server's processes from `/proc`, in nanoseconds, for the benchmarks: each
//! task's `schedstat` (time on a CPU and time runnable but waiting for one, in ns;
//! `/proc/PID/stat` counts in 10 ms ticks, too coarse for a loop of 20 ms).

#[cfg(test)]
use remora_gpubench::sched::SchedNs;
pub(crate) use remora_gpubench::sched::TaskSched;

/// The scheduler's times so far of each thread of `roots` and of those of their descendants
/// that have a thread named `marker` (session workers serving a connection; warm workers
/// still starting their driver have none): take two readings' difference with
/// [`TaskSched::since`]. Nothing for what cannot be read (a process gone, a kernel without
/// `schedstat`).
pub(crate) fn serving_sched(roots: &[u32], marker: &str) -> TaskSched {
    let mut all = TaskSched::default();
    for &pid in roots {
        all.merge(TaskSched::of_process(pid).unwrap_or_default());
    }
    all.merge(marked_sched(roots, marker));
    all
}

/// The scheduler's times so far of the threads of the descendants of `roots` that have a
/// thread named `marker`.
fn marked_sched(roots: &[u32], marker: &str) -> TaskSched {
    let mut all = TaskSched::default();
    for pid in descendants(roots)
        .into_iter()
        .filter(|&pid| has_thread(pid, marker))
    {
        all.merge(TaskSched::of_process(pid).unwrap_or_default());
    }
    all
}

/// Every descendant of `roots`, from each `/proc/PID/stat`'s parent field.
fn descendants(roots: &[u32]) -> Vec<u32> {
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
    tree.split_off(roots.len())
}

/// The parent pid of a `/proc/PID/stat` line: the second field after the command, which
/// is in parentheses and may itself hold spaces and parentheses.
fn parent_of(stat: &str) -> Option<u32> {
    let after = &stat[stat.rfind(')')? + 1..];
    after.split_whitespace().nth(1)?.parse().ok()
}

/// Whether a thread of `pid` is named `name`.
fn has_thread(pid: u32, name: &str) -> bool {
    std::fs::read_dir(format!("/proc/{pid}/task")).is_ok_and(|tasks| {
        tasks.flatten().any(|t| {
            std::fs::read_to_string(t.path().join("comm")).is_ok_and(|c| c.trim_end() == name)
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn the_parent_is_read_past_an_odd_command_name() {
        assert_eq!(parent_of("42 (a) b (c)) S 7 42 42 0"), Some(7));
        assert_eq!(parent_of("42 (remora) R 1 42"), Some(1));
        assert_eq!(parent_of("garbage"), None);
    }

    #[test]
    fn only_marked_children_count_and_their_work_does() {
        let me = std::process::id();
        // `sh -c 'exec -a NAME …'` is not portable; a process's main thread is named after
        // its command, so a busy `sh` is "sh" and a marker of "sh" picks it.
        let mut busy = std::process::Command::new("sh")
            .args(["-c", "while :; do :; done"])
            .spawn()
            .unwrap();
        assert!(descendants(&[me]).contains(&busy.id()));
        assert!(has_thread(busy.id(), "sh"));
        assert!(!has_thread(busy.id(), "no-such-thread"));
        let before = marked_sched(&[me], "sh");
        std::thread::sleep(Duration::from_millis(100));
        assert!(
            marked_sched(&[me], "sh").since(&before).on_cpu > 0,
            "the busy child's work counts"
        );
        assert_eq!(
            marked_sched(&[me], "no-such-thread").total(),
            SchedNs::default(),
            "an unmarked child does not count"
        );
        assert!(
            serving_sched(&[me], "no-such-thread").total().on_cpu > 0,
            "the root counts"
        );
        let _ = busy.kill();
        let _ = busy.wait();
        assert_eq!(serving_sched(&[u32::MAX], "sh").total(), SchedNs::default());
    }
}
