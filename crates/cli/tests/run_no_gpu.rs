//! `remora run` on a machine without a GPU: a driver-API C program, built against the CUDA
//! 13.0 headers and linked with Remora's libcuda.so, gets CUDA_ERROR_NO_DEVICE cleanly — no
//! crash, no hang — from an embedded server that has no driver.
//!
//! Needs the CUDA 13.0 headers (scripts/test installs the wheels and sets
//! REMORA_CUDA_INCLUDE) and the shim built in the same target directory; otherwise it prints
//! why it skipped.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const REMORA: &str = env!("CARGO_BIN_EXE_remora");

fn cuda_include() -> Option<PathBuf> {
    let dir = PathBuf::from(std::env::var_os("REMORA_CUDA_INCLUDE")?);
    dir.join("cuda.h").is_file().then_some(dir)
}

#[test]
fn driver_program_gets_no_device_through_remora_run() {
    let Some(include) = cuda_include() else {
        eprintln!("SKIPPED: no CUDA 13.0 headers (set REMORA_CUDA_INCLUDE; scripts/test does)");
        return;
    };
    let target = Path::new(REMORA).parent().unwrap();
    let Some(shim) = common::shim() else {
        eprintln!(
            "SKIPPED: the shim libcuda.so is not built in {}",
            target.display()
        );
        return;
    };
    let shim_dir = shim.parent().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let program = dir.path().join("driver_no_device");
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/c/driver_no_device.c");
    let cc = Command::new("cc")
        .arg("-I")
        .arg(&include)
        .arg(&source)
        .arg("-L")
        .arg(shim_dir)
        .args(["-lcuda", "-o"])
        .arg(&program)
        .output()
        .expect("run cc");
    assert!(
        cc.status.success(),
        "cc failed: {}",
        String::from_utf8_lossy(&cc.stderr)
    );

    let mut child = Command::new(REMORA)
        .args(["run", "--shim"])
        .arg(&shim)
        .arg("--")
        .arg(&program)
        .env("REMORA_REAL_LIBCUDA", "/nonexistent/libcuda.so.1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("the program hung under remora run");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        status.success(),
        "exit {status}\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
    assert!(
        stdout.contains("cuInit CUDA_ERROR_NO_DEVICE"),
        "{stdout}\n{stderr}"
    );
    // As with NVIDIA's driver after a failed cuInit.
    assert!(
        stdout.contains("cuDeviceGetCount CUDA_ERROR_NOT_INITIALIZED"),
        "{stdout}"
    );
    assert!(
        stdout.contains("cuDriverGetVersion CUDA_SUCCESS"),
        "{stdout}"
    );
}
