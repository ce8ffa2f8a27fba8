//! Helpers shared by the `remora` binary's integration tests.
#![allow(unreachable_pub)]

use std::path::{Path, PathBuf};

/// Remora's shim `libcuda.so` built beside the `remora` binary under test, if any. `cargo
/// test` refreshes the cdylib under deps/ but may leave an older copy beside the binaries:
/// the newest of the two.
#[allow(dead_code)]
pub fn shim() -> Option<PathBuf> {
    let target = Path::new(env!("CARGO_BIN_EXE_remora")).parent()?;
    [target.join("libcuda.so"), target.join("deps/libcuda.so")]
        .into_iter()
        .filter_map(|p| Some((std::fs::metadata(&p).ok()?.modified().ok()?, p)))
        .max()
        .map(|(_, p)| p)
}

/// A `remora serve` a test started: where it listens (from its "listening on" line) and its
/// log; killed on drop.
#[allow(dead_code)]
pub struct Served {
    pub child: std::process::Child,
    pub endpoint: remora_oncrpc::Endpoint,
    pub log: PathBuf,
}

#[allow(dead_code)]
impl Served {
    /// Starts `cmd` (a `remora serve` command line) with its standard error in `log`, and
    /// waits for the line that says where it listens; panics with the log without one.
    pub fn start(mut cmd: std::process::Command, log: &Path) -> Served {
        use std::io::BufRead;
        let mut child = cmd
            .stdout(std::process::Stdio::piped())
            .stderr(std::fs::File::create(log).unwrap())
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let Some((_, url)) = line.split_once("listening on ") else {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "remora serve did not start: {}",
                std::fs::read_to_string(log).unwrap()
            );
        };
        Served {
            endpoint: url.trim().parse().unwrap(),
            child,
            log: log.to_owned(),
        }
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Writes `text` to `dir/name` with mode 0600 (token and limits files must be private).
#[allow(dead_code)]
pub fn private_file(dir: &Path, name: &str, text: &str) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
    p
}
