//! The MPS control daemon for the benchmarks that measure under MPS (`bench fairness`,
//! `bench contention --sharing mps`): found, started when none runs, and stopped again.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use remora_server::gpu_share::{mps_daemon_listening, mps_pipe_dir};

/// The MPS control daemon this benchmark started; stopped (`quit`) on drop.
pub(crate) struct MpsDaemon {
    control: PathBuf,
}

impl MpsDaemon {
    /// A daemon listens on the control pipe (the pipe file outlives the daemon).
    pub(crate) fn running() -> bool {
        mps_daemon_listening(&mps_pipe_dir()).is_ok()
    }

    /// Starts the daemon and waits until its control pipe exists.
    pub(crate) fn start(control: &Path) -> Result<Self> {
        eprintln!(
            "remora: starting the MPS control daemon ({} -d)",
            control.display()
        );
        let status = Command::new(control)
            .arg("-d")
            .status()
            .with_context(|| format!("cannot run {}", control.display()))?;
        if !status.success() {
            bail!("{} -d failed ({status})", control.display());
        }
        let daemon = Self {
            control: control.to_owned(),
        };
        if wait_for(Duration::from_secs(10), Self::running).is_err() {
            let why = mps_daemon_listening(&mps_pipe_dir())
                .err()
                .unwrap_or_default();
            bail!("the MPS control daemon does not answer on its control pipe after 10 s: {why}");
        }
        Ok(daemon)
    }
}

impl Drop for MpsDaemon {
    fn drop(&mut self) {
        eprintln!("remora: stopping the MPS control daemon");
        let quit = Command::new(&self.control)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .spawn()
            .and_then(|mut c| {
                if let Some(mut i) = c.stdin.take() {
                    i.write_all(b"quit\n")?;
                }
                c.wait()
            });
        if let Err(e) = quit {
            eprintln!("remora: cannot stop the MPS control daemon: {e}");
        }
        if wait_for(Duration::from_secs(10), || !Self::running()).is_err() {
            eprintln!("remora: the MPS control daemon still answers 10 s after `quit`");
        }
    }
}

fn wait_for(limit: Duration, done: impl Fn() -> bool) -> Result<()> {
    let t0 = Instant::now();
    while !done() {
        if t0.elapsed() > limit {
            bail!("timed out");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

pub(crate) fn find_mps_control(explicit: Option<&Path>) -> Result<PathBuf> {
    if let Some(p) = explicit {
        return Ok(p.to_owned());
    }
    let name = "nvidia-cuda-mps-control";
    let on_path = std::env::var_os("PATH")
        .map(|p| {
            std::env::split_paths(&p)
                .map(|d| d.join(name))
                .collect::<Vec<_>>()
        })
        .unwrap_or_default();
    on_path
        .into_iter()
        .chain([Path::new("/usr/local/nvidia/bin").join(name)])
        .find(|p| p.is_file())
        .with_context(|| format!("cannot find {name}: give --mps-control PATH"))
}
