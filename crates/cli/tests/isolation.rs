//! Process isolation through the `remora` binary (emulated backend, no GPU): each session has
//! a worker process of its own, a worker killed by a signal takes only its own session, the
//! module cache is shared by the workers, and shutdown leaves no process or directory behind.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use remora_oncrpc::xdr::Bytes;
use remora_oncrpc::{Client, Endpoint};
use remora_proto::remora::*;
use sha2::{Digest, Sha256};

const REMORA: &str = env!("CARGO_BIN_EXE_remora");
const MODULE: &str = "REMORA-EMU-MODULE\nfunc axpy 4,8,8\nfunc empty\nglobal table 64\n";

/// Process ids whose parent is `parent` (from /proc), zombies excluded.
fn children(parent: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        // pid (comm) state ppid ...; comm may hold spaces.
        let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else {
            continue;
        };
        let mut fields = rest.split_whitespace();
        let state = fields.next().unwrap_or("");
        let ppid: u32 = fields.next().and_then(|p| p.parse().ok()).unwrap_or(0);
        if ppid == parent && state != "Z" {
            out.push(pid);
        }
    }
    out.sort_unstable();
    out
}

fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rsplit_once(')')
            .is_some_and(|(_, r)| !r.trim_start().starts_with('Z'))
    })
}

fn wait_until(what: &str, mut ok: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !ok() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

struct Serve {
    child: Child,
    endpoint: Endpoint,
    /// The rest of its standard output, after the listening line.
    stdout: BufReader<ChildStdout>,
}

impl Serve {
    fn start(dir: &Path, extra: &[&str]) -> Serve {
        let sock = dir.join("remora.sock");
        let mut child = Command::new(REMORA)
            .args(["serve", "--backend", "emulated", "--listen"])
            .arg(format!("unix://{}", sock.display()))
            .args(extra)
            .env("TMPDIR", dir.join("tmp"))
            .env(
                "REMORA_LOG",
                "info,remora::startup=debug,remora_server::worker_pool=debug",
            )
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(dir.join("serve.log")).unwrap())
            .spawn()
            .unwrap();
        let mut line = String::new();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        stdout.read_line(&mut line).unwrap();
        assert!(line.contains("listening on"), "{line}");
        Serve {
            child,
            endpoint: Endpoint::Unix(sock),
            stdout,
        }
    }

    /// SIGTERM, then the lines the server prints on its standard output until it closes it
    /// (exits), and its status.
    fn terminate_with_output(mut self) -> (std::process::ExitStatus, Vec<String>) {
        Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .unwrap();
        let lines = (&mut self.stdout)
            .lines()
            .map_while(Result::ok)
            .collect::<Vec<_>>();
        (self.terminate(), lines)
    }

    /// SIGTERM, then waits (at most 20 s) for the server to exit; its status.
    fn terminate(mut self) -> std::process::ExitStatus {
        Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                return s;
            }
            assert!(Instant::now() < deadline, "serve did not stop on SIGTERM");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn client(&self) -> RemoraV1Client {
        RemoraV1Client::new(Client::connect(&self.endpoint).unwrap())
            .with_timeout(Duration::from_secs(20))
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn primary(c: &RemoraV1Client) -> u64 {
    match c.rm_primary_ctx_retain(&0).unwrap() {
        RmHandleReply::Case0(h) => h,
        other => panic!("expected a context, got {other:?}"),
    }
}

fn alloc_works(c: &RemoraV1Client, ctx: u64) -> bool {
    matches!(
        c.rm_mem_alloc(&RmAllocArgs {
            ctx,
            bytesize: 4096
        }),
        Ok(RmU64Reply::Case0(_))
    )
}

fn hash() -> [u8; 32] {
    Sha256::digest(MODULE.as_bytes()).into()
}

fn load_by_hash(c: &RemoraV1Client, ctx: u64) -> RmLoadReply {
    c.rm_module_load(&RmModuleLoadArgs {
        ctx,
        hash: hash(),
        image: Bytes::new(),
    })
    .unwrap()
}

#[test]
fn a_killed_worker_takes_only_its_own_session_and_workers_share_the_module_cache() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("tmp")).unwrap();
    // No warm workers: every child is a session's.
    let serve = Serve::start(
        dir.path(),
        &["--isolation", "process", "--warm-workers", "0"],
    );
    let server_pid = serve.child.id();

    // Session A: its own worker; it sends the image once.
    let a = serve.client();
    let ctx_a = primary(&a);
    wait_until("A's worker runs", || children(server_pid).len() == 1);
    let worker_a = children(server_pid)[0];
    assert_eq!(load_by_hash(&a, ctx_a), RmLoadReply::RmNeedImage);
    let loaded = a
        .rm_module_load(&RmModuleLoadArgs {
            ctx: ctx_a,
            hash: hash(),
            image: Bytes::from(MODULE.as_bytes().to_vec()),
        })
        .unwrap();
    assert!(matches!(loaded, RmLoadReply::RmLoaded(_)), "{loaded:?}");

    // Session B: another worker, which loads the image by its hash alone.
    let b = serve.client();
    let ctx_b = primary(&b);
    wait_until("B's worker runs", || children(server_pid).len() == 2);
    let worker_b = *children(server_pid)
        .iter()
        .find(|p| **p != worker_a)
        .unwrap();
    assert_ne!(worker_a, worker_b);
    // A's worker writes the shared directory off the load's path: soon, not at once.
    wait_until(
        "the module cache is shared by the workers",
        || matches!(load_by_hash(&b, ctx_b), RmLoadReply::RmLoaded(m) if m.functions.len() == 2),
    );

    // A's worker dies by SIGKILL: A's session is gone, B's goes on.
    let killed = Command::new("kill")
        .args(["-KILL", &worker_a.to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    wait_until("A's worker is reaped", || {
        children(server_pid) == vec![worker_b]
    });
    assert!(
        a.rm_mem_alloc(&RmAllocArgs {
            ctx: ctx_a,
            bytesize: 1
        })
        .is_err()
    );
    assert!(alloc_works(&b, ctx_b), "B's session is untouched");
    assert_eq!(b.rm_ctx_synchronize(&ctx_b).unwrap().status, 0);

    // A new client gets a fresh worker, and the cached image.
    let c = serve.client();
    let ctx_c = primary(&c);
    assert!(alloc_works(&c, ctx_c));
    assert!(matches!(load_by_hash(&c, ctx_c), RmLoadReply::RmLoaded(_)));
    wait_until("C's worker runs", || children(server_pid).len() == 2);
    let workers = children(server_pid);
    assert!(!workers.contains(&worker_a));

    // Shutdown with live sessions: every worker ends, and so does the server.
    let status = serve.terminate();
    assert!(status.success(), "{status:?}");
    for pid in workers {
        assert!(!alive(pid), "worker {pid} outlived the server");
    }
    // The private module cache directory is gone.
    let left: Vec<_> = std::fs::read_dir(dir.path().join("tmp"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
    let log = std::fs::read_to_string(dir.path().join("serve.log")).unwrap();
    assert!(
        log.contains("session worker died by signal") && log.contains(&worker_a.to_string()),
        "{log}"
    );
    drop((a, b, c));
}

/// The worker pids the server's log says it handed sessions to, in order.
fn handed(dir: &Path) -> Vec<u32> {
    std::fs::read_to_string(dir.join("serve.log"))
        .unwrap()
        .lines()
        .filter(|l| l.contains("session handed to a worker"))
        .filter_map(|l| l.split("worker_pid=").nth(1))
        .filter_map(|p| p.split_whitespace().next()?.parse().ok())
        .collect()
}

/// A server under process isolation with two warm workers, both started before anyone
/// connects: its directory (the log is `serve.log` there), the server and its pid.
fn serve_with_two_warm_workers() -> (tempfile::TempDir, Serve, u32) {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("tmp")).unwrap();
    let serve = Serve::start(
        dir.path(),
        &["--isolation", "process", "--warm-workers", "2"],
    );
    let server_pid = serve.child.id();
    wait_until("two warm workers wait", || children(server_pid).len() == 2);
    (dir, serve, server_pid)
}

#[test]
fn warm_workers_wait_ahead_of_connections_and_each_serves_one_session() {
    let (dir, serve, server_pid) = serve_with_two_warm_workers();
    let warm = children(server_pid);

    // A's session goes to one of them; the pool starts a replacement.
    let a = serve.client();
    let ctx_a = primary(&a);
    assert!(alloc_works(&a, ctx_a));
    wait_until("the hand-off is logged", || handed(dir.path()).len() == 1);
    let worker_a = handed(dir.path())[0];
    assert!(warm.contains(&worker_a), "{worker_a} not in {warm:?}");
    wait_until("the pool is refilled", || children(server_pid).len() == 3);

    // B's session gets another worker that was already waiting.
    let b = serve.client();
    let ctx_b = primary(&b);
    assert!(alloc_works(&b, ctx_b));
    wait_until("B's hand-off is logged", || handed(dir.path()).len() == 2);
    let worker_b = handed(dir.path())[1];
    assert_ne!(worker_a, worker_b);
    assert!(warm.contains(&worker_b), "{worker_b} not in {warm:?}");

    // A worker serves one session only: A's exits when A closes, and takes no other.
    drop(a);
    wait_until("A's worker exits", || !alive(worker_a));
    // Exactly two: refills of two sessions at once never start more than --warm-workers.
    let deadline = Instant::now() + Duration::from_secs(20);
    while children(server_pid).len() != 3 {
        assert!(
            Instant::now() < deadline,
            "timed out waiting until two wait again beside B's: children {:?}, log:\n{}",
            children(server_pid),
            std::fs::read_to_string(dir.path().join("serve.log")).unwrap()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(alloc_works(&b, ctx_b));

    // Shutdown: B's worker and the waiting ones end, and so does the server.
    let all = children(server_pid);
    let status = serve.terminate();
    assert!(status.success(), "{status:?}");
    for pid in all {
        assert!(!alive(pid), "worker {pid} outlived the server");
    }
    drop(b);
}

#[test]
fn a_replacement_makes_its_context_once_the_session_that_caused_it_ends() {
    let (dir, serve, server_pid) = serve_with_two_warm_workers();
    let log = || std::fs::read_to_string(dir.path().join("serve.log")).unwrap();
    // The two started at start make their contexts at once (ungated).
    wait_until("both say they are ready", || {
        log().matches("session worker ready").count() == 2
    });
    assert!(!log().contains("gated_for"), "{}", log());

    // A takes one; another still waits ungated, so A's replacement is gated for A.
    let a = serve.client();
    let ctx_a = primary(&a);
    assert!(alloc_works(&a, ctx_a));
    wait_until("the pool is refilled", || children(server_pid).len() == 3);
    wait_until("the replacement is gated for A", || {
        log().contains("warm session worker started") && log().contains("gated_for=")
    });
    // A ends (or runs a second): the replacement gets its go and makes its context.
    drop(a);
    wait_until("the gated worker gets its go", || {
        log().contains("the server's go came")
    });
    assert!(
        log().contains("gated worker told to make its context"),
        "{}",
        log()
    );
    wait_until("three workers said they are ready", || {
        log().matches("session worker ready").count() == 3
    });

    // B and C take the two waiting workers. Their replacements are gated or not depending on
    // which hand-off comes first (C's, taking the last ungated worker, opens every gate and
    // refills ungated), but each gets its context at the latest when B or C has run a second:
    // every worker started ends up ready, none finds a session without its context made.
    let b = serve.client();
    let ctx_b = primary(&b);
    assert!(alloc_works(&b, ctx_b));
    let c = serve.client();
    let ctx_c = primary(&c);
    assert!(alloc_works(&c, ctx_c));
    wait_until("three hand-offs are logged", || {
        handed(dir.path()).len() == 3
    });
    wait_until("every worker started is ready", || {
        let l = log();
        l.matches("warm session worker started").count() >= 5
            && l.matches("warm session worker started").count()
                == l.matches("session worker ready").count()
    });
    assert!(!log().contains("no context made ahead"), "{}", log());
    let status = serve.terminate();
    assert!(status.success(), "{status:?}");
    drop((b, c));
}

#[test]
fn a_module_cache_directory_that_was_named_is_kept_and_threads_have_no_workers() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("tmp")).unwrap();
    let cache = dir.path().join("modules");
    let serve = Serve::start(
        dir.path(),
        &[
            "--isolation",
            "process",
            "--module-cache",
            cache.to_str().unwrap(),
        ],
    );
    let a = serve.client();
    let ctx = primary(&a);
    let loaded = a
        .rm_module_load(&RmModuleLoadArgs {
            ctx,
            hash: hash(),
            image: Bytes::from(MODULE.as_bytes().to_vec()),
        })
        .unwrap();
    assert!(matches!(loaded, RmLoadReply::RmLoaded(_)));
    // The worker's writer thread puts the image there soon after the load.
    wait_until("the image is in the named directory", || {
        std::fs::read_dir(&cache).is_ok_and(|d| d.count() == 1)
    });
    drop(a);
    drop(serve);
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&cache).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o700);
    assert_eq!(std::fs::read_dir(&cache).unwrap().count(), 1);

    // The emulated backend defaults to threads: no worker processes.
    let dir2 = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir2.path().join("tmp")).unwrap();
    let serve = Serve::start(dir2.path(), &[]);
    let c = serve.client();
    assert!(alloc_works(&c, primary(&c)));
    assert!(children(serve.child.id()).is_empty());
}

/// Issue 13 finding 7: a module cache directory others can write to (or read) is refused at
/// start, with what it is and what to do.
#[test]
fn serve_refuses_a_module_cache_directory_open_to_others() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("modules");
    std::fs::create_dir(&cache).unwrap();
    std::fs::set_permissions(&cache, std::fs::Permissions::from_mode(0o777)).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_remora"))
        .args(["serve", "--backend", "emulated", "--isolation", "process"])
        .args([
            "--listen",
            &format!("unix://{}", dir.path().join("s.sock").display()),
        ])
        .arg("--module-cache")
        .arg(&cache)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("mode 777") && err.contains("chmod 700"),
        "{err}"
    );
}

/// Session 28: a server whose warm workers were all taken (`remora run`'s embedded one) says
/// when every session's worker has destroyed its contexts, before the workers' exits (their
/// driver teardown), so that `remora run` returns then; with a warm worker still waiting
/// (a context of its own), it says only that it stopped.
#[test]
fn a_server_with_no_warm_worker_left_says_when_its_sessions_released_the_gpu() {
    let released = "remora serve: sessions released the GPU";
    let stopped = "remora serve: stopped";
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("tmp")).unwrap();
    let args = [
        "--isolation",
        "process",
        "--warm-workers",
        "1",
        "--no-warm-refill",
    ];
    let serve = Serve::start(dir.path(), &args);
    let server_pid = serve.child.id();
    let c = serve.client();
    let ctx = primary(&c);
    assert!(alloc_works(&c, ctx));
    let worker = children(server_pid);
    assert_eq!(worker.len(), 1, "one worker, its warm one not replaced");
    // The program ends, then `remora run` stops the server.
    drop(c);
    let (status, lines) = serve.terminate_with_output();
    assert!(status.success(), "{status:?}");
    assert_eq!(lines, [released, stopped], "released first, then stopped");
    assert!(
        !alive(worker[0]),
        "the worker is reaped before the server stops"
    );
    let log = std::fs::read_to_string(dir.path().join("serve.log")).unwrap();
    let worker_said = log
        .find("session worker released the GPU; exiting")
        .expect("the worker says it released the GPU");
    let pool_saw = log[worker_said..]
        .find("every session's worker released the GPU")
        .map(|at| at + worker_said);
    assert!(
        pool_saw.is_some(),
        "the server saw it after the worker said it:\n{log}"
    );
    assert!(
        log.contains("session worker released the GPU") && log.contains(&worker[0].to_string()),
        "{log}"
    );

    // Its warm worker never taken (a program that made no CUDA call): only stopped.
    let dir2 = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir2.path().join("tmp")).unwrap();
    let serve = Serve::start(dir2.path(), &args);
    wait_until("its warm worker runs", || {
        children(serve.child.id()).len() == 1
    });
    let (status, lines) = serve.terminate_with_output();
    assert!(status.success(), "{status:?}");
    assert_eq!(lines, [stopped]);
}

/// Four sessions at once, each with a context of its own and no MPS: the server says once
/// what the GPU's time-slicing between contexts costs and what to run instead (bench/results,
/// session 41), under process isolation (the accepting process counts the workers) and
/// thread isolation (the executor counts its sessions); three sessions say nothing.
#[test]
fn four_sessions_at_once_without_mps_hear_once_about_time_slicing() {
    let hint = "sessions are open at once, each with a GPU context of its own and no MPS";
    for isolation in ["process", "thread"] {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("tmp")).unwrap();
        // No MPS control daemon where the server would look for one.
        let serve = Serve::start(
            dir.path(),
            &["--isolation", isolation, "--warm-workers", "1"],
        );
        let log = dir.path().join("serve.log");
        let said = || std::fs::read_to_string(&log).unwrap().matches(hint).count();
        let open = |n: usize| -> Vec<RemoraV1Client> {
            (0..n)
                .map(|_| {
                    let c = serve.client();
                    // A call makes the session (and, under process isolation, its worker's).
                    assert!(alloc_works(&c, primary(&c)));
                    c
                })
                .collect()
        };
        let three = open(3);
        std::thread::sleep(Duration::from_millis(300));
        assert_eq!(said(), 0, "{isolation}: said with three sessions");
        let mut more = open(2);
        wait_until("the hint", || said() == 1);
        more.extend(open(1));
        std::thread::sleep(Duration::from_millis(300));
        let text = std::fs::read_to_string(&log).unwrap();
        assert_eq!(said(), 1, "{isolation}: said more than once:\n{text}");
        assert!(text.contains("--gpu-share mps"), "{text}");
        drop((three, more));
    }
}
