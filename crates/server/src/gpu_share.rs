//! Fair GPU sharing between tenants (issue 13 §3): `remora serve --gpu-share mps`.
//!
//! Contexts of separate processes time-share a GPU: when two are busy the GPU switches
//! between them every few milliseconds, so a tenant that keeps the GPU saturated delays every
//! launch of another by up to a time slice, and takes as much of the GPU as it asks for.
//! With NVIDIA's Multi-Process Service the kernels of different processes run side by side,
//! and each process may be held to a share of the SMs (`CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`
//! in its environment when it starts). Under process isolation every session has its own
//! worker process, so the server gives each worker its tenant's `gpu-share` (from
//! `--tenants`, or `--limit tenant.gpu-share=N`) as that variable:
//!
//! * the accepting process knows the tenant before a worker gets the connection (its client
//!   certificate, the token its first call presents, or its Unix user);
//! * a tenant with a share below 100% gets a worker started for its session with the
//!   variable set (warm workers, started before any tenant is known, serve only tenants
//!   with the whole GPU); its worker logs the share it runs with;
//! * MPS itself is the operator's: the control daemon (`nvidia-cuda-mps-control -d`) must
//!   be running for the server's user before `remora serve --gpu-share mps` starts, which
//!   checks for its pipe directory (`CUDA_MPS_PIPE_DIRECTORY`, default `/tmp/nvidia-mps`).
//!
//! Shares are caps, not reservations: a tenant at 50% uses at most half of the SMs even on
//! an idle GPU; shares that add up to more than 100% let tenants overlap. What MPS costs in
//! isolation is in docs/threat-model.md (one client's fatal fault reaches the others on that
//! GPU). A server without `--gpu-share mps` refuses to start when the limits name a share,
//! so that a share is never silently not enforced.

use std::path::PathBuf;

use crate::quota::{GpuShare, QuotaConfig};
use crate::serve::{Isolation, ServeError};

/// How GPU time is shared between tenants (`remora serve --gpu-share`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum GpuShareMode {
    /// The driver's time slicing between the sessions' contexts; `gpu-share` may not be set.
    #[default]
    Off,
    /// MPS: each session's worker process runs with its tenant's `gpu-share` as its active
    /// thread percentage.
    Mps,
}

impl std::str::FromStr for GpuShareMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "off" => Ok(Self::Off),
            "mps" => Ok(Self::Mps),
            _ => Err(format!("unknown GPU sharing {s:?}: use off or mps")),
        }
    }
}

/// The variable MPS reads in a client process's environment when the process starts.
pub const MPS_PERCENT_ENV: &str = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE";

/// Where the MPS control daemon keeps its pipes (`CUDA_MPS_PIPE_DIRECTORY`, or NVIDIA's
/// default).
pub fn mps_pipe_dir() -> PathBuf {
    std::env::var_os("CUDA_MPS_PIPE_DIRECTORY")
        .filter(|d| !d.is_empty())
        .map_or_else(|| PathBuf::from("/tmp/nvidia-mps"), PathBuf::from)
}

/// Whether an MPS control daemon listens in `dir`: its `control` pipe must exist *and* have the
/// daemon at its other end. The pipe outlives the daemon (after `quit`, or a crash), so the
/// file alone would let a server start, or a session run, whose share the driver then silently
/// ignores. A FIFO with no reader refuses a non-blocking open for writing (ENXIO); a socket
/// with no listener refuses a connection. Answers why not, when not.
pub fn mps_daemon_listening(dir: &std::path::Path) -> Result<(), String> {
    use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
    let control = dir.join("control");
    let meta = std::fs::metadata(&control)
        .map_err(|e| format!("{} has no `control` pipe ({e})", dir.display()))?;
    let t = meta.file_type();
    // Only "nobody at the other end" means stale: ENXIO for a FIFO, ECONNREFUSED for a
    // socket. Any other answer (the daemon's socket is not a stream socket: EPROTOTYPE;
    // permissions) still shows a daemon there.
    let answer = |r: std::io::Result<()>, nobody: rustix::io::Errno| match r {
        Err(e) if e.raw_os_error() == Some(nobody.raw_os_error()) => Err(format!(
            "{} is left from a daemon that no longer runs ({e})",
            control.display()
        )),
        _ => Ok(()),
    };
    if t.is_fifo() {
        let open = std::fs::OpenOptions::new()
            .write(true)
            .custom_flags(rustix::fs::OFlags::NONBLOCK.bits() as i32)
            .open(&control);
        answer(open.map(drop), rustix::io::Errno::NXIO)
    } else if t.is_socket() {
        let connect = std::os::unix::net::UnixStream::connect(&control);
        answer(connect.map(drop), rustix::io::Errno::CONNREFUSED)
    } else {
        Ok(())
    }
}

/// Sessions open at once from which a server whose sessions each have a GPU context of their
/// own says, once, what the GPU's time-slicing between contexts costs ([`note_sessions`]):
/// with 4 clients the unloaded H200 already took ~550 µs for an empty kernel's launch +
/// synchronize, natively as through Remora (bench/results, session 27).
pub(crate) const SLICING_HINT_SESSIONS: usize = 4;

/// The line [`note_sessions`] logs, for `sessions` open at once.
pub(crate) fn slicing_hint(sessions: usize) -> String {
    format!(
        "{sessions} sessions are open at once, each with a GPU context of its own and no MPS. \
         When several keep the GPU busy together, the GPU time-slices between their contexts \
         and a short kernel waits for the others' slices: with 16 clients on an H200 an \
         empty kernel's launch + synchronize took 822 us (p50), natively as through Remora, \
         and 9 us under MPS (bench/results, session 41). For many concurrent sessions start \
         the MPS control daemon (nvidia-cuda-mps-control -d) and run remora serve \
         --gpu-share mps (process isolation); under MPS a fault in one session reaches the \
         others on that GPU (docs/threat-model.md)"
    )
}

/// Says once per process ([`slicing_hint`], INFO), when `sessions` sessions are open at once
/// and reach [`SLICING_HINT_SESSIONS`], that the GPU time-slices between their contexts;
/// not when an MPS control daemon is running (the driver then puts every context of this
/// user in its MPS server, `--gpu-share mps` or not). Called by the accepting process of
/// process isolation as each session is handed to its worker, and by the executor as each
/// session begins (thread isolation; a session worker's executor has one session only).
/// Answers whether it logged.
pub(crate) fn note_sessions(sessions: usize) -> bool {
    static HINT: SlicingHint = SlicingHint::new();
    HINT.note(sessions, || mps_daemon_listening(&mps_pipe_dir()).is_ok())
}

/// Whether [`slicing_hint`] was said ([`note_sessions`]'s state, one per process).
struct SlicingHint(std::sync::atomic::AtomicBool);

impl SlicingHint {
    const fn new() -> Self {
        Self(std::sync::atomic::AtomicBool::new(false))
    }

    /// Logs the hint the first time `sessions` reaches [`SLICING_HINT_SESSIONS`] while
    /// `mps_running` says no MPS control daemon runs (asked only then); answers whether it
    /// logged.
    fn note(&self, sessions: usize, mps_running: impl FnOnce() -> bool) -> bool {
        use std::sync::atomic::Ordering;
        if sessions < SLICING_HINT_SESSIONS || self.0.load(Ordering::Relaxed) || mps_running() {
            return false;
        }
        if self.0.swap(true, Ordering::Relaxed) {
            return false;
        }
        tracing::info!(sessions, "{}", slicing_hint(sessions));
        true
    }
}

/// Checks, before anything starts, that `mode` can enforce what `quota` asks for.
pub(crate) fn check_start(
    mode: GpuShareMode,
    isolation: Isolation,
    quota: &QuotaConfig,
) -> Result<(), ServeError> {
    match mode {
        GpuShareMode::Off => {
            if let Some((who, share)) = quota.limited_share() {
                return Err(ServeError::GpuShare(format!(
                    "the limits give {who} gpu-share = {share}, which only MPS enforces: \
                     start the MPS control daemon (nvidia-cuda-mps-control -d) and add \
                     --gpu-share mps, or remove gpu-share from --tenants/--limit"
                )));
            }
            Ok(())
        }
        GpuShareMode::Mps => {
            if isolation != Isolation::Process {
                return Err(ServeError::GpuShare(
                    "--gpu-share mps needs process isolation (MPS limits each session's own \
                     worker process): leave out --isolation thread"
                        .into(),
                ));
            }
            let dir = mps_pipe_dir();
            if let Err(why) = mps_daemon_listening(&dir) {
                return Err(ServeError::GpuShare(format!(
                    "--gpu-share mps: no MPS control daemon is running ({why}). Start it as \
                     the user this server runs as, with `nvidia-cuda-mps-control -d` (and the \
                     same CUDA_MPS_PIPE_DIRECTORY, if set), then start remora serve again"
                )));
            }
            match quota.limited_share() {
                Some(_) => tracing::info!(
                    mps_pipe_dir = %dir.display(),
                    "GPU shares enforced through MPS: each tenant's sessions run with its \
                     gpu-share as their active thread percentage"
                ),
                None => tracing::info!(
                    "--gpu-share mps with no tenant's gpu-share below 100 (--tenants, --limit \
                     tenant.gpu-share=N): sessions run side by side in the MPS server with the \
                     whole GPU each, with no time-slicing between their contexts"
                ),
            }
            Ok(())
        }
    }
}

/// The share a session worker of `tenant` is started with, when less than the whole GPU.
pub(crate) fn worker_share(quota: &QuotaConfig, tenant: &str) -> Option<GpuShare> {
    Some(quota.gpu_share_of(tenant)).filter(|s| s.is_limited())
}

/// In a session worker: logs the MPS share its server started it with, and answers why the
/// share cannot hold, if it cannot (the MPS control daemon has gone since the server started:
/// the driver would then ignore the variable and give the session the whole GPU, so the
/// session is refused instead).
pub(crate) fn worker_share_problem() -> Option<String> {
    let p = std::env::var_os(MPS_PERCENT_ENV)?;
    let p = p.to_string_lossy();
    let dir = mps_pipe_dir();
    if let Err(why) = mps_daemon_listening(&dir) {
        let why = format!(
            "the tenant's gpu-share ({p}%) cannot be enforced: no MPS control daemon runs on \
             the server ({why}); the operator must start it (nvidia-cuda-mps-control -d)"
        );
        tracing::error!("{why}; refusing the session");
        return Some(why);
    }
    tracing::info!(
        active_thread_percentage = %p,
        "this session's worker runs under MPS with its tenant's gpu-share"
    );
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_slicing_hint_is_said_once_from_four_sessions_and_never_under_mps() {
        let hint = SlicingHint::new();
        assert!(!hint.note(3, || panic!("MPS is not asked below the threshold")));
        // A running MPS daemon puts every context in its server: nothing to say.
        assert!(!hint.note(4, || true));
        assert!(hint.note(4, || false));
        assert!(!hint.note(16, || false));
        let line = slicing_hint(16);
        assert!(line.starts_with("16 sessions are open at once"), "{line}");
        assert!(line.contains("--gpu-share mps"), "{line}");
        assert!(line.contains("nvidia-cuda-mps-control -d"), "{line}");
    }

    #[test]
    fn a_control_pipe_counts_only_with_a_daemon_at_its_end() {
        use std::os::unix::fs::OpenOptionsExt;
        let dir = tempfile::tempdir().unwrap();
        let missing = mps_daemon_listening(dir.path()).unwrap_err();
        assert!(missing.contains("has no `control` pipe"), "{missing}");
        // A FIFO left by a daemon that quit: no reader.
        let control = dir.path().join("control");
        let made = std::process::Command::new("mkfifo")
            .arg(&control)
            .status()
            .unwrap();
        assert!(made.success());
        let stale = mps_daemon_listening(dir.path()).unwrap_err();
        assert!(stale.contains("no longer runs"), "{stale}");
        // A reader holds it open, as the daemon does.
        let _reader = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(rustix::fs::OFlags::NONBLOCK.bits() as i32)
            .open(&control)
            .unwrap();
        mps_daemon_listening(dir.path()).unwrap();
        // A socket: only a listener counts.
        let sockets = tempfile::tempdir().unwrap();
        let path = sockets.path().join("control");
        drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
        assert!(mps_daemon_listening(sockets.path()).is_err());
        std::fs::remove_file(&path).unwrap();
        let _listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        mps_daemon_listening(sockets.path()).unwrap();
    }

    #[test]
    fn modes_parse_and_say_what_they_take() {
        assert_eq!("off".parse(), Ok(GpuShareMode::Off));
        assert_eq!("mps".parse(), Ok(GpuShareMode::Mps));
        let e = "MPS".parse::<GpuShareMode>().unwrap_err();
        assert!(e.contains("off or mps"), "{e}");
    }

    #[test]
    fn a_share_without_mps_or_mps_without_processes_refuses_to_start() {
        let mut q = QuotaConfig::default();
        assert!(check_start(GpuShareMode::Off, Isolation::Thread, &q).is_ok());
        q.apply_toml("[tenants.bob]\ngpu-share = 50\n").unwrap();
        let e = check_start(GpuShareMode::Off, Isolation::Process, &q)
            .unwrap_err()
            .to_string();
        assert!(e.contains("tenant bob gpu-share = 50%"), "{e}");
        assert!(e.contains("--gpu-share mps"), "{e}");
        let e = check_start(GpuShareMode::Mps, Isolation::Thread, &q)
            .unwrap_err()
            .to_string();
        assert!(e.contains("process isolation"), "{e}");
        assert_eq!(worker_share(&q, "bob").map(GpuShare::percent), Some(50));
        assert_eq!(worker_share(&q, "alice"), None);
    }
}
