//! Process isolation's session workers: a pool of warm workers, each started ahead of its
//! session, and the hand-off of an accepted connection to one of them.
//!
//! A worker (`remora serve-worker`) gets a private Unix socket (its standard input) to the
//! server instead of a connection. It loads the driver, initialises it and makes a context
//! (`Backend::prewarm`) while it waits; the server then passes it one accepted connection
//! with `SCM_RIGHTS`, with the session's page-lock budget and the peer's name
//! ([`handoff_message`]). A worker serves exactly one connection and exits; the server starts
//! a new one to keep `--warm-workers` waiting. Start-up of a program against a standing
//! server thus no longer waits for a process, the driver's initialisation and a context
//! (~110 ms on the H100 host). A warm worker has no session state and no tenant: nothing
//! of one session reaches the next, as before.

use std::collections::{HashMap, VecDeque};
use std::ffi::OsString;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::os::unix::process::ExitStatusExt;
use std::process::{Command, ExitStatus, Stdio};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use remora_oncrpc::{AcceptedConnection, ConnectionHandler, Origin, Peer};

use crate::serve::WORKER_GRACE;

/// The live sessions' workers, by connection id.
#[derive(Default)]
pub(crate) struct Workers {
    live: Mutex<HashMap<u64, LiveWorker>>,
}

/// A worker serving a session.
pub(crate) struct LiveWorker {
    pub(crate) pid: u32,
    /// A clone of its control socket, where the session's lanes are handed (revision 16);
    /// `None` if it could not be cloned.
    control: Option<UnixStream>,
    exit: Arc<Exit>,
}

impl Workers {
    pub(crate) fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, LiveWorker>> {
        self.live.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// What the page-lock cap `cap` leaves for one more session when `live` sessions with areas
/// of `area` bytes each may hold theirs.
pub(crate) fn lock_budget(live: usize, area: u64, cap: u64) -> u64 {
    cap.saturating_sub(area.saturating_mul(live as u64))
}

/// How long a session's worker may take to say it is ready before the pool starts its
/// replacement anyway.
const READY_WAIT: Duration = Duration::from_secs(10);
/// The byte a worker writes on its control socket once its driver and context are ready
/// (or, for a gated one, once its session has come: see [`GATE_ENV`]).
pub(crate) const READY: u8 = b'R';
/// The byte a worker writes on its control socket once it has served its session and holds
/// nothing on the GPU (its session's contexts destroyed, an unused warm context too): what
/// is left is its process's exit, whose driver teardown took ~50 ms on the H200 host
/// (session 28) and which a server shutting down need not wait for to say that the GPU is
/// released ([`WorkerPool::wait_released`]).
pub(crate) const RELEASED: u8 = b'F';
/// Set in the environment of a *gated* worker: a replacement started while a session runs.
/// It loads and initialises its driver at once, but makes its context only when the server
/// sends [`GO`] (or not at all, when a connection comes first: the session then makes its
/// own). Making a context while a session runs slows that session's driver calls about
/// twofold (H200, session 27: a short program's context release 137-142 ms against 59 ms,
/// its `cuMemFree` 13 ms against 0.3 ms; two processes making contexts at once took
/// 180-215 ms each against 113 ms alone), so a replacement makes its context when the
/// session that took its predecessor ends, after [`GATE_AFTER`] of it, or at once when no
/// other worker waits ungated for the next connection.
pub(crate) const GATE_ENV: &str = "REMORA_WORKER_GATED";
/// The byte the server sends a gated worker when it may make its context.
pub(crate) const GO: u8 = b'G';
/// Set in the environment of a *warm* worker, one started ahead of the session it will get
/// (not one started for a session that found none waiting). A warm worker whose driver failed
/// to initialise withdraws ([`withdraw`]): its `cuInit` ran at some earlier moment (an MPS
/// server that is starting or stopping answers `CUDA_ERROR_MPS_CONNECTION_FAILED` for a
/// moment), and the session it would get deserves a worker that tries now.
pub(crate) const WARM_ENV: &str = "REMORA_WORKER_WARM";

/// Withdraws a warm worker from the pool: after this, the server's hand-off to it fails
/// (`EPIPE`), and the server takes another worker. `true` when no hand-off had come before
/// (the worker may exit); `false` when one had, which it then serves.
pub(crate) fn withdraw(control: &UnixStream) -> bool {
    // A stream socket shut for reading makes the peer's sends fail; what was queued before
    // stays readable.
    if let Err(e) = rustix::net::shutdown(control, rustix::net::Shutdown::Read) {
        tracing::warn!(error = %e, "cannot withdraw this warm worker from the pool; it stays");
        return false;
    }
    let mut byte = [0u8; 1];
    !matches!(
        rustix::net::recv(
            control,
            &mut byte,
            rustix::net::RecvFlags::PEEK | rustix::net::RecvFlags::DONTWAIT
        ),
        Ok((n, _)) if n > 0
    )
}
/// How long a session may run before the replacement it caused makes its context anyway.
const GATE_AFTER: Duration = Duration::from_secs(1);

/// First line of the hand-off message.
const HANDOFF_MAGIC: &str = "remora-session 3";
/// First line of the message that hands a worker a lane of its session (revision 16); the
/// rest is as in a session's hand-off (budget and slot 0, unused).
const LANE_MAGIC: &str = "remora-lane 1";
/// Largest hand-off message (the peer's name is cut to fit).
pub(crate) const MAX_HANDOFF: usize = 512;

/// The bytes sent with a connection's descriptor, one per line: the magic line, the
/// page-lock budget, the session's slot in the limits ledger, `tls` or `plain`, the tenant of a TLS client certificate (empty when
/// none; a valid tenant name), the peer's TCP address for a TLS connection (whose
/// descriptor is a socket pair's plaintext end; empty otherwise), and last the peer's name
/// (for logs).
pub(crate) fn handoff_message(budget: u64, slot: usize, origin: &Origin, peer: &str) -> Vec<u8> {
    message(HANDOFF_MAGIC, budget, slot, origin, peer)
}

/// The bytes sent with a lane's descriptor ([`LANE_MAGIC`]).
pub(crate) fn lane_message(origin: &Origin, peer: &str) -> Vec<u8> {
    message(LANE_MAGIC, 0, 0, origin, peer)
}

/// What a message on a worker's control socket hands it.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Message {
    /// Its session's connection.
    Session(HandOff),
    /// Another connection of its session: a lane.
    Lane(HandOff),
}

/// Parses a message on a worker's control socket.
pub(crate) fn parse_message(bytes: &[u8]) -> Option<Message> {
    if bytes.starts_with(LANE_MAGIC.as_bytes()) {
        parse(LANE_MAGIC, bytes).map(Message::Lane)
    } else {
        parse_handoff(bytes).map(Message::Session)
    }
}

fn message(magic: &str, budget: u64, slot: usize, origin: &Origin, peer: &str) -> Vec<u8> {
    let tcp_peer = match &origin.peer {
        Some(Peer::Tcp(addr)) if origin.tls => addr.to_string(),
        _ => String::new(),
    };
    let mut m = format!(
        "{magic}\n{budget}\n{slot}\n{}\n{}\n{tcp_peer}\n",
        if origin.tls { "tls" } else { "plain" },
        origin.tenant.as_deref().unwrap_or(""),
    );
    let room = MAX_HANDOFF.saturating_sub(m.len() + 1);
    let mut cut = peer.len().min(room);
    while !peer.is_char_boundary(cut) {
        cut -= 1;
    }
    m.push_str(&peer[..cut].replace('\n', " "));
    m.push('\n');
    m.into_bytes()
}

/// What a hand-off message says.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct HandOff {
    pub(crate) budget: u64,
    /// The session's slot in the limits ledger.
    pub(crate) slot: usize,
    /// The peer's name, for logs.
    pub(crate) peer: String,
    /// TLS, the certificate's tenant, the TCP peer of a TLS connection.
    pub(crate) origin: Origin,
}

/// Parses [`handoff_message`].
pub(crate) fn parse_handoff(bytes: &[u8]) -> Option<HandOff> {
    parse(HANDOFF_MAGIC, bytes)
}

fn parse(magic: &str, bytes: &[u8]) -> Option<HandOff> {
    let text = std::str::from_utf8(bytes).ok()?;
    let mut lines = text.split('\n');
    if lines.next()? != magic {
        return None;
    }
    let budget = lines.next()?.parse().ok()?;
    let slot = lines.next()?.parse().ok()?;
    let tls = match lines.next()? {
        "tls" => true,
        "plain" => false,
        _ => return None,
    };
    let tenant = match lines.next()? {
        "" => None,
        t if remora_oncrpc::tls::tenant_name_problem(t).is_none() && tls => Some(t.to_owned()),
        _ => return None,
    };
    let tcp_peer = match lines.next()? {
        "" if !tls => None,
        addr => Some(Peer::Tcp(addr.parse().ok()?)),
    };
    Some(HandOff {
        budget,
        slot,
        peer: lines.next()?.to_string(),
        origin: Origin {
            peer: tcp_peer,
            tls,
            tenant,
        },
    })
}

/// How a worker process ended, once it has: set by the thread that started it.
#[derive(Default)]
struct Exit {
    status: Mutex<Option<Option<ExitStatus>>>,
    ended: Condvar,
}

impl Exit {
    fn get(&self) -> Option<Option<ExitStatus>> {
        *self.status.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Waits up to `timeout` for the end; the status if it came.
    fn wait(&self, timeout: Duration) -> Option<Option<ExitStatus>> {
        let guard = self.status.lock().unwrap_or_else(PoisonError::into_inner);
        let (guard, _) = self
            .ended
            .wait_timeout_while(guard, timeout, |s| s.is_none())
            .unwrap_or_else(PoisonError::into_inner);
        *guard
    }
}

/// A started worker waiting for its connection.
struct Worker {
    pid: u32,
    control: UnixStream,
    exit: Arc<Exit>,
    started: Instant,
    /// A gated worker ([`GATE_ENV`]) not sent [`GO`] yet: the connection whose session's
    /// hand-off started it.
    gate: Option<u64>,
}

impl Worker {
    fn signal(&self, signal: rustix::process::Signal) {
        if self.exit.get().is_none()
            && let Some(pid) = rustix::process::Pid::from_raw(self.pid as i32)
        {
            let _ = rustix::process::kill_process(pid, signal);
        }
    }
}

/// Starts session workers ahead of their connections and hands each accepted connection to
/// one ([`ConnectionHandler`]); waits for the worker on the connection's thread.
pub(crate) struct WorkerPool {
    command: Vec<OsString>,
    args: Vec<OsString>,
    pub(crate) workers: Workers,
    /// (bytes of one session's data area, the server's page-lock cap): each worker is told
    /// what the cap leaves after the areas of the workers alive.
    lock: (u64, u64),
    /// Workers kept started and waiting (`--warm-workers`).
    pub(crate) warm_target: usize,
    /// Start a replacement when a session takes a warm worker (`--no-warm-refill`: no, as
    /// `remora run`'s embedded server, whose one program has one session).
    refill: bool,
    warm: Mutex<Warm>,
    /// The limits ledger the workers inherit ([`crate::quota`]): a slot is claimed for each
    /// session handed to a worker and cleared when that worker ends, however it ends.
    ledger: Arc<crate::quota::Ledger>,
    /// Under `--gpu-share mps`, the limits whose `gpu-share` each session's worker is
    /// started with ([`crate::gpu_share`]).
    shares: Option<crate::quota::QuotaConfig>,
    /// Sessions whose workers may still hold something on the GPU: counted from the
    /// connection's acceptance until its worker says [`RELEASED`] or exits (or the hand-off
    /// fails).
    holding: Holding,
}

/// [`WorkerPool::holding`]: a count and the condition its waiters wait on.
#[derive(Default)]
struct Holding {
    count: Mutex<usize>,
    changed: Condvar,
}

/// One session counted in [`WorkerPool::holding`] until [`Hold::release`] or its drop.
struct Hold<'a> {
    holding: &'a Holding,
    held: bool,
}

impl<'a> Hold<'a> {
    fn new(holding: &'a Holding) -> Self {
        *holding.count.lock().unwrap_or_else(PoisonError::into_inner) += 1;
        Self {
            holding,
            held: true,
        }
    }

    fn release(&mut self) {
        if std::mem::take(&mut self.held) {
            let mut count = self
                .holding
                .count
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            *count = count.saturating_sub(1);
            self.holding.changed.notify_all();
        }
    }
}

impl Drop for Hold<'_> {
    fn drop(&mut self) {
        self.release();
    }
}

/// Watches a session worker's control socket for [`RELEASED`] while the pool waits for the
/// worker's exit.
struct ReleaseWatch {
    /// Until the worker said [`RELEASED`] or closed its end.
    open: bool,
}

impl ReleaseWatch {
    fn new() -> Self {
        Self { open: true }
    }

    /// Waits up to `timeout` for the worker to write on `control`, reads what it wrote (never
    /// blocking: the socket's other users keep it blocking), and says whether that made it
    /// [`RELEASED`] just now. The other bytes a worker writes ([`READY`], unread by a pool
    /// that does not refill) are passed over. Once the worker has closed its end, or said
    /// [`RELEASED`], this only sleeps: the caller waits on the exit.
    fn poll(&mut self, control: &UnixStream, timeout: Duration) -> bool {
        use rustix::event::{PollFd, PollFlags, Timespec, poll};
        let timespec = Timespec::try_from(timeout).unwrap_or(Timespec {
            tv_sec: 0,
            tv_nsec: 20_000_000,
        });
        let mut fds = [PollFd::new(control, PollFlags::IN)];
        match poll(&mut fds, Some(&timespec)) {
            Ok(0) | Err(rustix::io::Errno::INTR) => return false,
            Ok(_) => {}
            // Never expected; the caller then waits on the exit alone rather than spin here.
            Err(_) => {
                self.open = false;
                return false;
            }
        }
        let mut bytes = [0u8; 16];
        match rustix::net::recv(control, &mut bytes, rustix::net::RecvFlags::DONTWAIT) {
            Ok((0, _)) => self.open = false,
            Ok((n, _)) => {
                if bytes[..n].contains(&RELEASED) {
                    self.open = false;
                    return true;
                }
            }
            Err(rustix::io::Errno::AGAIN | rustix::io::Errno::INTR) => {}
            Err(_) => self.open = false,
        }
        false
    }
}

/// The waiting workers, and how many are being started (so that two sessions' refills
/// never start more than `warm_target` between them).
#[derive(Default)]
struct Warm {
    waiting: VecDeque<Worker>,
    starting: usize,
}

impl WorkerPool {
    /// A pool that starts `command` + `args` (`remora serve-worker …`) and keeps
    /// `warm_target` of them waiting once [`WorkerPool::fill`] is called.
    pub(crate) fn new(
        command: Vec<OsString>,
        args: Vec<OsString>,
        ledger: Arc<crate::quota::Ledger>,
        lock: (u64, u64),
        warm_target: usize,
        refill: bool,
        shares: Option<crate::quota::QuotaConfig>,
    ) -> Self {
        Self {
            command,
            args,
            ledger,
            workers: Workers::default(),
            lock,
            warm_target,
            refill,
            warm: Mutex::default(),
            shares,
            holding: Holding::default(),
        }
    }

    /// Hands connection `conn`, whose first call joins the session that process `route`
    /// serves as a lane, to that worker; closes it when no worker of this server has that id.
    fn hand_lane(&self, conn: AcceptedConnection, route: u64) {
        let peer = conn.peer().clone();
        let control = self
            .workers
            .lock()
            .values()
            .find(|w| u64::from(w.pid) == route)
            .and_then(|w| Some((w.control.as_ref()?.try_clone().ok()?, Arc::clone(&w.exit))));
        let Some((control, exit)) = control else {
            remora_oncrpc::audit!(info, "auth_failed", %peer, route,
                "a lane for a session this server does not serve (its key names no live worker); connection closed");
            return;
        };
        let fd = match conn.try_clone_fd() {
            Ok(fd) => fd,
            Err(e) => {
                tracing::error!(%peer, error = %e, "cannot pass a lane to its session's worker; closed");
                return;
            }
        };
        let message = lane_message(&conn.origin(), &peer.to_string());
        match remora_shm::send_with_fd(&control, &message, fd.as_fd()) {
            Ok(()) => {
                tracing::debug!(%peer, worker_pid = route, "lane handed to its session's worker")
            }
            Err(e) => {
                tracing::info!(%peer, worker_pid = route, error = %e, "cannot pass a lane to its session's worker (it has ended?); closed");
                return;
            }
        }
        // The server shuts the socket down when this returns (for every process that holds
        // it): the lane lives as long as its session's worker, or until shutdown.
        while exit.wait(Duration::from_millis(100)).is_none() && !conn.shutting_down() {}
    }

    /// Starts a worker, with an MPS share of the GPU when `share` says so ([`crate::gpu_share`]),
    /// gated ([`GATE_ENV`]) for connection `gate`'s session when that is given, warm
    /// ([`WARM_ENV`]) when started ahead of its session. The thread
    /// that starts it stays with it until it exits: the worker dies with that thread
    /// (`PR_SET_PDEATHSIG`), and it reaps it.
    fn start(
        &self,
        share: Option<crate::quota::GpuShare>,
        gate: Option<u64>,
        warm: bool,
    ) -> io::Result<Worker> {
        let Some((program, leading)) = self.command.split_first() else {
            return Err(io::Error::other("no worker command"));
        };
        let (ours, theirs) = UnixStream::pair()?;
        let mut cmd = Command::new(program);
        cmd.args(leading)
            .args(&self.args)
            .stdin(Stdio::from(OwnedFd::from(theirs)))
            .stdout(Stdio::null())
            .env("REMORA_SERVE_PID", std::process::id().to_string());
        match share {
            Some(share) => cmd.env(
                crate::gpu_share::MPS_PERCENT_ENV,
                share.percent().to_string(),
            ),
            // Not this server's own setting (if it has one) either: a worker without a share
            // has the whole GPU.
            None => cmd.env_remove(crate::gpu_share::MPS_PERCENT_ENV),
        };
        match gate {
            Some(_) => cmd.env(GATE_ENV, "1"),
            None => cmd.env_remove(GATE_ENV),
        };
        match warm {
            true => cmd.env(WARM_ENV, "1"),
            false => cmd.env_remove(WARM_ENV),
        };
        let exit = Arc::new(Exit::default());
        let (tx, rx) = std::sync::mpsc::channel();
        let keeper_exit = Arc::clone(&exit);
        std::thread::Builder::new()
            .name("remora-worker".into())
            .spawn(move || {
                let mut child = match cmd.spawn() {
                    Ok(c) => c,
                    Err(e) => {
                        let _ = tx.send(Err(e));
                        return;
                    }
                };
                let _ = tx.send(Ok(child.id()));
                drop(cmd);
                let status = child.wait().ok();
                *keeper_exit
                    .status
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner) = Some(status);
                keeper_exit.ended.notify_all();
            })?;
        let pid = rx
            .recv()
            .map_err(|_| io::Error::other("the worker's thread ended"))??;
        Ok(Worker {
            pid,
            control: ours,
            exit,
            started: Instant::now(),
            gate,
        })
    }

    /// Starts workers until `warm_target` wait (counting those being started).
    pub(crate) fn fill(&self) {
        self.fill_for(None);
    }

    /// [`WorkerPool::fill`], the workers gated for connection `gate`'s session when given.
    fn fill_for(&self, gate: Option<u64>) {
        loop {
            {
                let mut warm = self.lock_warm();
                if warm.waiting.len() + warm.starting >= self.warm_target {
                    return;
                }
                warm.starting += 1;
            }
            let started = self.start(None, gate, true);
            let mut warm = self.lock_warm();
            warm.starting -= 1;
            match started {
                Ok(w) => {
                    tracing::debug!(
                        worker_pid = w.pid,
                        gated_for = gate,
                        "warm session worker started"
                    );
                    warm.waiting.push_back(w);
                }
                Err(e) => {
                    tracing::error!(error = %e, "cannot start a warm session worker");
                    return;
                }
            }
        }
    }

    /// Sends [`GO`] to the waiting workers gated for connection `opener`'s session, or to
    /// every gated one when `opener` is `None`.
    fn open_gates(&self, opener: Option<u64>) {
        let mut warm = self.lock_warm();
        for w in warm.waiting.iter_mut() {
            if w.gate.is_some() && (opener.is_none() || w.gate == opener) {
                w.gate = None;
                // A worker that is gone fails its hand-off later and is passed over then.
                if let Err(e) = std::io::Write::write_all(&mut &w.control, &[GO]) {
                    tracing::debug!(worker_pid = w.pid, error = %e, "cannot tell a gated worker to make its context");
                } else {
                    tracing::debug!(
                        worker_pid = w.pid,
                        ?opener,
                        "gated worker told to make its context"
                    );
                }
            }
        }
    }

    fn lock_warm(&self) -> std::sync::MutexGuard<'_, Warm> {
        self.warm.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A worker for a new connection: the oldest warm one still alive that is not gated
    /// (its context made, or being made), else the oldest gated one, else a new one.
    fn take(&self) -> io::Result<Worker> {
        loop {
            let next = {
                let mut warm = self.lock_warm();
                let ungated = warm.waiting.iter().position(|w| w.gate.is_none());
                warm.waiting.remove(ungated.unwrap_or(0))
            };
            let Some(w) = next else {
                break;
            };
            if let Some(status) = w.exit.get() {
                // One that exited cleanly withdrew (`withdraw`) and said why.
                if status.is_some_and(|s| s.success()) {
                    tracing::debug!(
                        worker_pid = w.pid,
                        "a warm session worker had withdrawn; not used"
                    );
                } else {
                    tracing::warn!(
                        worker_pid = w.pid,
                        ?status,
                        "a warm session worker had exited; not used"
                    );
                }
                continue;
            }
            return Ok(w);
        }
        self.start(None, None, false)
    }

    /// Whether no warm worker waits or is being started: one holds a context of its own
    /// until the shutdown ends it, as in a standing server's pool that refills. Only when
    /// none does (`remora run`'s embedded server, whose program took its one warm worker)
    /// does [`WorkerPool::wait_released`] say anything before the workers' exits.
    pub(crate) fn no_warm_worker(&self) -> bool {
        let warm = self.lock_warm();
        warm.waiting.is_empty() && warm.starting == 0
    }

    /// Waits until no session's worker holds anything on the GPU: each said [`RELEASED`] or
    /// exited.
    pub(crate) fn wait_released(&self) {
        let mut count = self
            .holding
            .count
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        while *count > 0 {
            count = self
                .holding
                .changed
                .wait(count)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// Ends the warm workers (server shutdown): each is killed at once and reaped (waiting at
    /// most [`WORKER_GRACE`]). A warm worker holds no session, and one still starting its
    /// driver would otherwise finish that (its driver start and context, ~240 ms on the H200
    /// host) before it read the closed control socket, only to tear it all down: what
    /// `remora run` of a program that never calls CUDA waited for.
    pub(crate) fn drain(&self) {
        let idle: Vec<Worker> = self.lock_warm().waiting.drain(..).collect();
        for w in &idle {
            w.signal(rustix::process::Signal::KILL);
        }
        for w in idle {
            match w.exit.wait(WORKER_GRACE) {
                Some(_) => tracing::debug!(
                    worker_pid = w.pid,
                    "warm session worker ended at shutdown (it held no session)"
                ),
                None => tracing::warn!(
                    worker_pid = w.pid,
                    "warm session worker killed at shutdown but not reaped within the grace"
                ),
            }
        }
    }
}

impl ConnectionHandler for WorkerPool {
    fn handle(&self, conn: AcceptedConnection) {
        if let Some(route) = conn.route() {
            return self.hand_lane(conn, route);
        }
        // Counted from here, before its worker is chosen, so that a shutdown never sees a
        // session between its acceptance and its hand-off as none.
        let mut hold = Hold::new(&self.holding);
        let peer = conn.peer().clone();
        let id = conn.id();
        let fd: OwnedFd = match conn.try_clone_fd() {
            Ok(fd) => fd,
            Err(e) => {
                tracing::error!(%peer, error = %e, "cannot pass the connection to a session worker; closed");
                return;
            }
        };
        let budget = lock_budget(self.workers.lock().len(), self.lock.0, self.lock.1);
        let Some(slot) = self.ledger.claim() else {
            remora_oncrpc::audit!(error, limit "tenants", %peer, connection = id,
                slots = self.ledger.slots(),
                "no free slot in the limits ledger (more sessions than it counts); connection closed");
            return;
        };
        // Cleared when this function returns, whatever the worker did with it.
        struct Release<'a>(&'a crate::quota::Ledger, usize);
        impl Drop for Release<'_> {
            fn drop(&mut self) {
                self.0.release(self.1);
            }
        }
        let _release = Release(&self.ledger, slot);
        let message = handoff_message(budget, slot, &conn.origin(), &peer.to_string());
        // A tenant with a share of the GPU gets a worker started for it with that share; the
        // warm ones, started before any tenant was known, have the whole GPU.
        let share = self.shares.as_ref().and_then(|q| {
            let tenant = q.tenant_of(conn.authenticated_tenant(), &peer);
            crate::gpu_share::worker_share(q, &tenant).map(|s| (tenant, s))
        });
        // A warm worker that died since it started fails the hand-off: take another.
        let mut tries = 0;
        let worker = loop {
            tries += 1;
            let w = match &share {
                Some((tenant, s)) => {
                    tracing::info!(%peer, connection = id, %tenant, gpu_share = %s,
                        "starting a session worker with the tenant's share of the GPU (MPS)");
                    self.start(Some(*s), None, false)
                }
                None => self.take(),
            };
            let w = match w {
                Ok(w) => w,
                Err(e) => {
                    tracing::error!(%peer, error = %e, "cannot start a session worker; connection closed");
                    return;
                }
            };
            match remora_shm::send_with_fd(&w.control, &message, fd.as_fd()) {
                Ok(()) => break w,
                Err(e) if tries < 3 => {
                    tracing::warn!(%peer, worker_pid = w.pid, error = %e, "a session worker did not take its connection; trying another");
                    w.signal(rustix::process::Signal::KILL);
                }
                Err(e) => {
                    tracing::error!(%peer, worker_pid = w.pid, error = %e, "cannot pass the connection to a session worker; closed");
                    w.signal(rustix::process::Signal::KILL);
                    return;
                }
            }
        };
        drop(fd);
        let pid = worker.pid;
        // Its control socket is where the session's lanes go, until the worker ends.
        let control = worker
            .control
            .try_clone()
            .inspect_err(|e| {
                tracing::warn!(worker_pid = pid, error = %e, "the session's lanes cannot be handed to its worker");
            })
            .ok();
        let live = {
            let mut workers = self.workers.lock();
            workers.insert(
                id,
                LiveWorker {
                    pid,
                    control,
                    exit: Arc::clone(&worker.exit),
                },
            );
            workers.len()
        };
        // Without --gpu-share mps every session's worker has a context of its own.
        if self.shares.is_none() {
            crate::gpu_share::note_sessions(live);
        }
        tracing::info!(
            %peer, connection = id, worker_pid = pid,
            warm_ms = worker.started.elapsed().as_millis() as u64,
            "session handed to a worker"
        );
        // Replace it while the session runs, once its worker is ready (it says so on the
        // control socket): two workers making contexts at once slow both (254 ms instead
        // of ~150 ms on the H100 host), and the session's is the one a program waits for.
        // While another worker waits ungated for the next connection, the replacement is
        // gated: its context waits until this session ends or has run GATE_AFTER
        // (`GATE_ENV`). When none does, every gated worker makes its context now, and so does
        // this replacement.
        let refill = self.refill && share.is_none() && !conn.shutting_down();
        let mut gated = false;
        if refill {
            gated = self.lock_warm().waiting.iter().any(|w| w.gate.is_none());
            if !gated {
                self.open_gates(None);
            }
            let _ = worker.control.set_read_timeout(Some(READY_WAIT));
            let _ = std::io::Read::read(&mut &worker.control, &mut [0u8; 1]);
            self.fill_for(gated.then_some(id));
        }
        let session_start = Instant::now();
        let mut stopping_since: Option<Instant> = None;
        let mut termed = false;
        let mut watch = ReleaseWatch::new();
        let status = loop {
            let status = if watch.open {
                if watch.poll(&worker.control, Duration::from_millis(20)) {
                    hold.release();
                    tracing::debug!(
                        target: "remora::startup",
                        connection = id,
                        worker_pid = pid,
                        "session worker released the GPU"
                    );
                }
                worker.exit.get()
            } else {
                worker.exit.wait(Duration::from_millis(20))
            };
            if let Some(status) = status {
                break status;
            }
            if gated && session_start.elapsed() >= GATE_AFTER {
                self.open_gates(Some(id));
                gated = false;
            }
            if conn.shutting_down() {
                let since = *stopping_since.get_or_insert_with(Instant::now);
                if !termed && since.elapsed() >= WORKER_GRACE {
                    tracing::warn!(%peer, worker_pid = pid, "session worker still running after shutdown began; SIGTERM");
                    worker.signal(rustix::process::Signal::TERM);
                    termed = true;
                } else if termed && since.elapsed() >= 2 * WORKER_GRACE {
                    tracing::warn!(%peer, worker_pid = pid, "session worker ignored SIGTERM; killed");
                    worker.signal(rustix::process::Signal::KILL);
                    break worker.exit.wait(WORKER_GRACE).flatten();
                }
            }
        };
        self.workers.lock().remove(&id);
        if gated {
            self.open_gates(Some(id));
        }
        match status {
            Some(s) if s.success() => {
                tracing::info!(%peer, connection = id, worker_pid = pid, "session worker finished")
            }
            Some(s) => match s.signal() {
                Some(sig) if termed => {
                    tracing::info!(%peer, worker_pid = pid, signal = sig, "session worker stopped at shutdown")
                }
                Some(sig) => tracing::error!(
                    %peer, connection = id, worker_pid = pid, signal = sig,
                    "session worker died by signal; only this session is lost"
                ),
                None => tracing::warn!(
                    %peer, connection = id, worker_pid = pid, code = s.code(),
                    "session worker exited with an error"
                ),
            },
            None => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_release_byte_is_found_among_the_others_and_an_eof_ends_the_watch() {
        let (pool_end, worker_end) = UnixStream::pair().unwrap();
        let tick = Duration::from_millis(5);
        let mut watch = ReleaseWatch::new();
        assert!(!watch.poll(&pool_end, tick), "nothing written yet");
        assert!(watch.open);
        // A pool that does not refill never reads the ready byte: passed over.
        std::io::Write::write_all(&mut &worker_end, &[READY]).unwrap();
        assert!(!watch.poll(&pool_end, tick));
        assert!(watch.open);
        std::io::Write::write_all(&mut &worker_end, &[READY, RELEASED]).unwrap();
        assert!(watch.poll(&pool_end, tick), "released");
        assert!(!watch.open, "then the pool waits on the exit alone");

        let (pool_end, worker_end) = UnixStream::pair().unwrap();
        let mut watch = ReleaseWatch::new();
        drop(worker_end);
        assert!(!watch.poll(&pool_end, tick), "an exit without the byte");
        assert!(!watch.open);
    }

    #[test]
    fn wait_released_returns_once_every_hold_is_released_or_dropped() {
        let pool = Arc::new(WorkerPool::new(
            Vec::new(),
            Vec::new(),
            Arc::new(crate::quota::Ledger::new(2).unwrap()),
            (0, 0),
            0,
            false,
            None,
        ));
        assert!(pool.no_warm_worker());
        pool.wait_released();
        let mut first = Hold::new(&pool.holding);
        let second = Hold::new(&pool.holding);
        let (tx, rx) = std::sync::mpsc::channel();
        let waiter = {
            let pool = Arc::clone(&pool);
            std::thread::spawn(move || {
                pool.wait_released();
                tx.send(()).unwrap();
            })
        };
        first.release();
        first.release();
        assert!(
            rx.recv_timeout(Duration::from_millis(100)).is_err(),
            "one session still holds the GPU (a second release counts once)"
        );
        drop(second);
        rx.recv_timeout(Duration::from_secs(10))
            .expect("released once the last hold goes");
        waiter.join().unwrap();
        drop(first);
        assert_eq!(*pool.holding.count.lock().unwrap(), 0);
        pool.lock_warm().starting = 1;
        assert!(
            !pool.no_warm_worker(),
            "a worker being started holds a context"
        );
    }

    #[test]
    fn each_worker_gets_what_the_lock_cap_leaves() {
        assert_eq!(lock_budget(0, 256 << 20, 1 << 30), 1 << 30);
        assert_eq!(lock_budget(3, 256 << 20, 1 << 30), 256 << 20);
        assert_eq!(lock_budget(4, 256 << 20, 1 << 30), 0);
        assert_eq!(lock_budget(9, 256 << 20, 1 << 30), 0);
        assert_eq!(lock_budget(usize::MAX, u64::MAX, 5), 0);
    }

    #[test]
    fn handoff_messages_round_trip_and_stay_bounded() {
        let plain = Origin {
            peer: Some(Peer::Unix {
                pid: 7,
                uid: 0,
                gid: 0,
            }),
            ..Origin::default()
        };
        let m = handoff_message(123, 4, &plain, "unix pid 7 uid 0 gid 0");
        let h = parse_handoff(&m).unwrap();
        assert_eq!(
            (h.budget, h.slot, h.peer.as_str()),
            (123, 4, "unix pid 7 uid 0 gid 0")
        );
        assert_eq!(
            h.origin,
            Origin::default(),
            "a plain peer is read from the socket"
        );
        let addr: std::net::SocketAddr = "[::1]:4000".parse().unwrap();
        let tls = Origin {
            peer: Some(Peer::Tcp(addr)),
            tls: true,
            tenant: Some("alice".into()),
        };
        let m = handoff_message(5, 0, &tls, "tcp [::1]:4000");
        assert_eq!(parse_handoff(&m).unwrap().origin, tls);
        let long = "é".repeat(1000);
        let m = handoff_message(u64::MAX, usize::MAX, &tls, &long);
        assert!(m.len() <= MAX_HANDOFF);
        let h = parse_handoff(&m).unwrap();
        assert_eq!((h.budget, h.slot), (u64::MAX, usize::MAX));
        assert!(long.starts_with(&h.peer) && !h.peer.is_empty());
        assert_eq!(h.origin, tls);
        assert_eq!(parse_handoff(b"remora-session 2\n1\n2\npeer\n"), None);
        assert_eq!(
            parse_handoff(b"remora-session 3\nx\n2\nplain\n\n\npeer\n"),
            None
        );
        assert_eq!(
            parse_handoff(b"remora-session 3\n1\nx\nplain\n\n\npeer\n"),
            None
        );
        assert_eq!(
            parse_handoff(b"remora-session 3\n1\n2\ntls\nbad name\n[::1]:1\npeer\n"),
            None
        );
        assert_eq!(
            parse_handoff(b"remora-session 3\n1\n2\ntls\n\n\npeer\n"),
            None
        );
        assert_eq!(parse_handoff(b"\xff"), None);
    }
}
