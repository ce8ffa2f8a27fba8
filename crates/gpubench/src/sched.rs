//! What the scheduler says of a process's threads, from each task's `/proc` `schedstat`
//! (time on a CPU and time runnable but waiting for one, in ns; `/proc/PID/stat` counts in
//! 10 ms ticks, too coarse for a loop of 20 ms): the benchmarks' CPU and run-queue figures,
//! of a worker itself and of the servers around it.

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

/// The sum of the `schedstat`s of every live task of `pid`; None when none can be read (a
/// process gone, a kernel without scheduler statistics, a sandbox).
pub fn process_sched_ns(pid: u32) -> Option<SchedNs> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).ok()?;
    let mut read = tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
        .filter_map(|s| parse_schedstat(&s))
        .peekable();
    read.peek()?;
    Some(read.sum())
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
    fn threads_that_outnumber_the_cores_wait_in_the_run_queue() {
        let Some(before) = process_sched_ns(std::process::id()).map(|s| s.waiting) else {
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
            let during = process_sched_ns(std::process::id()).map(|s| s.waiting);
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
