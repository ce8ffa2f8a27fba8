//! A session's waiter threads. They run its blocking calls (synchronize, long copies) and send
//! their deferred replies, so that the connection thread goes on reading other client threads'
//! calls meanwhile.
//!
//! Threads start on demand, up to a bound, and then stay parked on a condition variable until
//! the session closes: starting a thread per blocking call cost tens of microseconds per call
//! (measured on the H100 machine: a synchronize with nothing to wait for took 21 µs on the
//! server, nearly all of it `thread::spawn`).

use std::collections::VecDeque;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;

/// One blocking call, replying by itself.
pub(crate) type Job = Box<dyn FnOnce() + Send + 'static>;

#[derive(Default)]
struct State {
    jobs: VecDeque<Job>,
    /// Threads parked, waiting for a job.
    idle: usize,
    /// Threads started and not finished.
    threads: usize,
    closing: bool,
}

#[derive(Default)]
struct Shared {
    state: Mutex<State>,
    wake: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Up to `max` threads running [`Job`]s in the order they were submitted.
pub(crate) struct WaiterPool {
    name: String,
    max: usize,
    shared: Arc<Shared>,
    handles: Mutex<Vec<JoinHandle<()>>>,
}

impl WaiterPool {
    /// A pool whose threads are named `name` and number at most `max`.
    pub(crate) fn new(name: String, max: usize) -> Self {
        Self {
            name,
            max,
            shared: Arc::default(),
            handles: Mutex::new(Vec::new()),
        }
    }

    /// Hands `job` to a waiter thread, starting one if none is free and fewer than `max`
    /// run. Gives the job back when every thread is busy, a thread cannot be started, or the
    /// pool is closing: the caller then runs it itself.
    pub(crate) fn submit(&self, job: Job) -> Result<(), Job> {
        let mut st = self.shared.lock();
        if st.closing {
            return Err(job);
        }
        if st.idle > st.jobs.len() {
            st.jobs.push_back(job);
            drop(st);
            self.shared.wake.notify_one();
            return Ok(());
        }
        if st.threads >= self.max {
            return Err(job);
        }
        let shared = Arc::clone(&self.shared);
        let spawned = std::thread::Builder::new()
            .name(self.name.clone())
            .spawn(move || run(&shared));
        match spawned {
            Ok(h) => {
                st.threads += 1;
                st.jobs.push_back(job);
                drop(st);
                self.handles
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .push(h);
                Ok(())
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot start a waiter thread; the call runs on the connection thread");
                Err(job)
            }
        }
    }

    /// Runs the jobs already submitted, then stops and joins every thread. Later submissions
    /// are given back.
    pub(crate) fn close(&self) {
        self.shared.lock().closing = true;
        self.shared.wake.notify_all();
        let handles =
            std::mem::take(&mut *self.handles.lock().unwrap_or_else(PoisonError::into_inner));
        for h in handles {
            join_unless_current(h);
        }
    }

    /// Threads started and not finished.
    #[cfg(test)]
    fn threads(&self) -> usize {
        self.shared.lock().threads
    }

    /// Waits until every thread is parked.
    #[cfg(test)]
    fn settle(&self) {
        while {
            let st = self.shared.lock();
            st.idle < st.threads
        } {
            std::thread::yield_now();
        }
    }
}

/// Joins thread `h` unless it is the calling thread: a thread that drops what owns it (a job
/// holding the last reference to its session) must not join itself; it ends when it returns.
pub(crate) fn join_unless_current(h: JoinHandle<()>) {
    if h.thread().id() != std::thread::current().id() {
        let _ = h.join();
    }
}

impl Drop for WaiterPool {
    fn drop(&mut self) {
        self.close();
    }
}

fn run(shared: &Shared) {
    let mut st = shared.lock();
    loop {
        if let Some(job) = st.jobs.pop_front() {
            drop(st);
            if catch_unwind(AssertUnwindSafe(job)).is_err() {
                tracing::error!("a blocking call panicked on a waiter thread");
            }
            st = shared.lock();
            continue;
        }
        if st.closing {
            st.threads -= 1;
            return;
        }
        st.idle += 1;
        st = shared.wake.wait(st).unwrap_or_else(PoisonError::into_inner);
        st.idle -= 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::mpsc;
    use std::time::Duration;

    #[test]
    fn threads_are_reused_and_bounded_and_jobs_all_run() {
        let pool = WaiterPool::new("test-waiter".into(), 2);
        let done = Arc::new(AtomicUsize::new(0));
        for _ in 0..50 {
            let d = Arc::clone(&done);
            let (tx, rx) = mpsc::channel();
            pool.submit(Box::new(move || {
                d.fetch_add(1, Ordering::SeqCst);
                tx.send(()).unwrap();
            }))
            .map_err(|_| "refused")
            .unwrap();
            rx.recv_timeout(Duration::from_secs(10)).unwrap();
            pool.settle();
        }
        assert_eq!(done.load(Ordering::SeqCst), 50);
        // One job at a time: the first thread, parked between jobs, took every one.
        assert_eq!(pool.threads(), 1);
        // Two jobs blocking at once use both threads; a third is given back.
        let (release_tx, release_rx) = mpsc::channel::<()>();
        let release_rx = Arc::new(Mutex::new(release_rx));
        let (started_tx, started_rx) = mpsc::channel();
        for _ in 0..2 {
            let r = Arc::clone(&release_rx);
            let s = started_tx.clone();
            pool.submit(Box::new(move || {
                s.send(()).unwrap();
                let _ = r.lock().unwrap().recv();
            }))
            .map_err(|_| "refused")
            .unwrap();
        }
        // Both started: one waits in recv, the other for the receiver's lock.
        started_rx.recv_timeout(Duration::from_secs(10)).unwrap();
        started_rx.recv_timeout(Duration::from_secs(10)).unwrap();
        assert_eq!(pool.threads(), 2);
        assert!(pool.submit(Box::new(|| {})).is_err());
        release_tx.send(()).unwrap();
        release_tx.send(()).unwrap();
        pool.close();
        assert_eq!(pool.threads(), 0);
        assert!(pool.submit(Box::new(|| {})).is_err(), "closed");
    }

    #[test]
    fn close_waits_for_the_job_in_flight() {
        let pool = WaiterPool::new("test-waiter".into(), 1);
        let done = Arc::new(AtomicUsize::new(0));
        let d = Arc::clone(&done);
        pool.submit(Box::new(move || {
            std::thread::sleep(Duration::from_millis(20));
            d.fetch_add(1, Ordering::SeqCst);
        }))
        .map_err(|_| "refused")
        .unwrap();
        pool.close();
        assert_eq!(done.load(Ordering::SeqCst), 1);
        assert_eq!(pool.threads(), 0);
    }

    #[test]
    fn a_panicking_job_does_not_kill_the_pool() {
        let pool = WaiterPool::new("test-waiter".into(), 1);
        pool.submit(Box::new(|| panic!("boom")))
            .map_err(|_| "refused")
            .unwrap();
        let (tx, rx) = mpsc::channel();
        // The thread may still be busy with the panic: retry until it takes the job.
        let mut job: Job = Box::new(move || tx.send(()).unwrap());
        for _ in 0..1000 {
            match pool.submit(job) {
                Ok(()) => break,
                Err(j) => {
                    job = j;
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        }
        rx.recv_timeout(Duration::from_secs(10)).unwrap();
        assert_eq!(pool.threads(), 1);
    }
}
