//! What the scheduler says of a process's threads, from each task's `/proc` `schedstat`
//! (time on a CPU and time runnable but waiting for one, in ns; `/proc/PID/stat` counts in
//! 10 ms ticks, too coarse for a loop of 20 ms): the benchmarks' CPU and run-queue figures,
//! of a worker itself and of the servers around it.

use std::collections::BTreeMap;
use std::ops::{Add, Sub};

/// What the scheduler says of a set of threads so far (sums of their `schedstat`s), in ns.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SchedNs {
    /// Time on a CPU (the first field).
    pub on_cpu: u64,
    /// Time runnable but waiting in a run queue for a CPU (the second field): what a wake-up
    /// costs beyond its own work when the cores are taken.
    pub waiting: u64,
}

impl Add for SchedNs {
    type Output = SchedNs;
    fn add(self, o: SchedNs) -> SchedNs {
        SchedNs {
            on_cpu: self.on_cpu.saturating_add(o.on_cpu),
            waiting: self.waiting.saturating_add(o.waiting),
        }
    }
}

impl Sub for SchedNs {
    type Output = SchedNs;
    /// What passed between an earlier reading and this one (0 where a thread went away).
    fn sub(self, earlier: SchedNs) -> SchedNs {
        SchedNs {
            on_cpu: self.on_cpu.saturating_sub(earlier.on_cpu),
            waiting: self.waiting.saturating_sub(earlier.waiting),
        }
    }
}

impl std::iter::Sum for SchedNs {
    fn sum<I: Iterator<Item = SchedNs>>(iter: I) -> SchedNs {
        iter.fold(SchedNs::default(), Add::add)
    }
}

/// The `schedstat` of each live task of some processes, by (pid, tid): a reading to take the
/// difference of task by task ([`TaskSched::since`]). A sum over the live tasks drops by a
/// task's whole time when it exits, so the difference of two sums can lose the others' time
/// (it read 0 once for a server whose waiter thread ended during the loop).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TaskSched(BTreeMap<(u32, u32), SchedNs>);

impl TaskSched {
    /// Every live task of `pid`; None when none can be read (a process gone, a kernel
    /// without scheduler statistics, a sandbox).
    pub fn of_process(pid: u32) -> Option<TaskSched> {
        let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).ok()?;
        let read: BTreeMap<(u32, u32), SchedNs> = tasks
            .flatten()
            .filter_map(|t| {
                let tid = t.file_name().to_str()?.parse::<u32>().ok()?;
                let line = std::fs::read_to_string(t.path().join("schedstat")).ok()?;
                Some(((pid, tid), parse_schedstat(&line)?))
            })
            .collect();
        (!read.is_empty()).then_some(TaskSched(read))
    }

    /// Adds the tasks of another reading (of other processes).
    pub fn merge(&mut self, other: TaskSched) {
        self.0.extend(other.0);
    }

    /// The sum over the tasks read.
    pub fn total(&self) -> SchedNs {
        self.0.values().copied().sum()
    }

    /// What the tasks of this reading did since `earlier`, task by task: a task read both
    /// times counts its difference, a task that started in between all of its time. A task
    /// that exited in between counts nothing: its time after `earlier` is not known (a lower
    /// bound, never a drop of the others' time).
    pub fn since(&self, earlier: &TaskSched) -> SchedNs {
        self.0
            .iter()
            .map(|(task, now)| match earlier.0.get(task) {
                Some(before) => *now - *before,
                None => *now,
            })
            .sum()
    }

    /// A reading of the given tasks, for tests.
    #[cfg(test)]
    fn of(tasks: &[((u32, u32), u64, u64)]) -> TaskSched {
        TaskSched(
            tasks
                .iter()
                .map(|&(k, on_cpu, waiting)| (k, SchedNs { on_cpu, waiting }))
                .collect(),
        )
    }
}

/// A `schedstat` line ("on-CPU ns, waiting ns, timeslices").
fn parse_schedstat(line: &str) -> Option<SchedNs> {
    let mut f = line.split_whitespace().map(str::parse::<u64>);
    Some(SchedNs {
        on_cpu: f.next()?.ok()?,
        waiting: f.next()?.ok()?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

    #[test]
    fn differences_are_taken_task_by_task() {
        let before = TaskSched::of(&[((1, 1), 100, 10), ((1, 2), 5_000, 500), ((2, 2), 50, 5)]);
        // Task 1/2 (its time the largest) exited; 1/3 started; 1/1 and 2/2 went on.
        let after = TaskSched::of(&[((1, 1), 160, 13), ((1, 3), 30, 3), ((2, 2), 70, 9)]);
        assert_eq!(
            after.since(&before),
            SchedNs {
                on_cpu: 60 + 30 + 20,
                waiting: 3 + 3 + 4
            }
        );
        // The sums' difference loses everything to the exited task.
        assert_eq!(after.total() - before.total(), SchedNs::default());
        let mut both = TaskSched::of(&[((1, 1), 1, 1)]);
        both.merge(TaskSched::of(&[((2, 1), 2, 2)]));
        assert_eq!(
            both.total(),
            SchedNs {
                on_cpu: 3,
                waiting: 3
            }
        );
    }

    #[test]
    fn a_thread_that_exits_takes_nothing_from_the_others() {
        let me = std::process::id();
        let Some(before) = TaskSched::of_process(me) else {
            eprintln!("skipped: this kernel's /proc has no schedstat");
            return;
        };
        // A thread busy for a while, gone before the second reading; then this thread busy.
        std::thread::spawn(|| {
            let t = std::time::Instant::now();
            while t.elapsed() < Duration::from_millis(60) {
                std::hint::spin_loop();
            }
        })
        .join()
        .unwrap();
        let t = std::time::Instant::now();
        while t.elapsed() < Duration::from_millis(20) {
            std::hint::spin_loop();
        }
        let after = TaskSched::of_process(me).unwrap();
        assert!(
            after.since(&before).on_cpu >= 10_000_000,
            "this thread's 20 ms count: {:?}",
            after.since(&before)
        );
    }

    #[test]
    fn threads_that_outnumber_the_cores_wait_in_the_run_queue() {
        let Some(before) = TaskSched::of_process(std::process::id()).map(|t| t.total().waiting)
        else {
            eprintln!("skipped: this kernel's /proc has no schedstat");
            return;
        };
        // Two more busy threads than this process may use cores: some of them are always
        // runnable without a core, and their waiting shows while they are alive.
        let n = std::thread::available_parallelism().map_or(1, |n| n.get()) + 2;
        let stop = AtomicBool::new(false);
        let during = std::thread::scope(|s| {
            for _ in 0..n {
                s.spawn(|| {
                    while !stop.load(Ordering::Relaxed) {
                        std::hint::spin_loop();
                    }
                });
            }
            std::thread::sleep(Duration::from_millis(200));
            let during = TaskSched::of_process(std::process::id()).map(|t| t.total().waiting);
            stop.store(true, Ordering::Relaxed);
            during
        });
        let during = during.expect("readable a moment ago");
        assert!(
            during > before + 1_000_000,
            "{n} busy threads waited {} ns in 200 ms",
            during - before
        );
    }

    #[test]
    fn a_schedstat_line_gives_both_times() {
        assert_eq!(
            parse_schedstat("123456 7890 42\n"),
            Some(SchedNs {
                on_cpu: 123456,
                waiting: 7890
            })
        );
        assert_eq!(parse_schedstat("123"), None);
        assert_eq!(parse_schedstat("x y z"), None);
        let a = SchedNs {
            on_cpu: 10,
            waiting: 5,
        };
        let b = SchedNs {
            on_cpu: 4,
            waiting: 7,
        };
        assert_eq!(
            a - b,
            SchedNs {
                on_cpu: 6,
                waiting: 0
            },
            "a thread gone between readings counts 0, not a wrapped figure"
        );
        assert_eq!(
            a + b,
            SchedNs {
                on_cpu: 14,
                waiting: 12
            }
        );
    }
}
