//! `remora run` on a machine without a GPU: a driver-API C program, built against the CUDA
//! 13.0 headers and linked with Remora's libcuda.so, gets CUDA_ERROR_NO_DEVICE cleanly — no
//! crash, no hang — from an embedded server that has no driver.
//!
//! Needs the CUDA 13.0 headers (scripts/test installs the wheels and sets
//! REMORA_CUDA_INCLUDE) and the shim built in the same target directory; otherwise it prints
//! why it skipped. The warning test needs only the shim and a C compiler.

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

/// A C program that loads `libcuda.so.1` as the CUDA runtime does (no headers needed) and
/// calls cuInit (given an argument, also cuDevicePrimaryCtxRetain).
const CU_INIT_C: &str = r#"
#include <dlfcn.h>
#include <stdio.h>
int main(int argc, char **argv) {
    (void)argv;
    void *h = dlopen("libcuda.so.1", RTLD_NOW);
    if (!h) { printf("dlopen: %s\n", dlerror()); return 1; }
    int (*cu_init)(unsigned) = (int (*)(unsigned))dlsym(h, "cuInit");
    if (!cu_init) { printf("no cuInit\n"); return 1; }
    printf("cuInit %d\n", cu_init(0));
    if (argc > 1) {
        int (*retain)(void **, int) = (int (*)(void **, int))dlsym(h, "cuDevicePrimaryCtxRetain");
        void *ctx = 0;
        printf("cuDevicePrimaryCtxRetain %d\n", retain ? retain(&ctx, 0) : -1);
    }
    return 0;
}
"#;

/// Builds the C source `text` in `dir` as `dir/name`, with `args` (before `-o`).
fn build_c(dir: &Path, text: &str, name: &str, args: &[&str]) -> PathBuf {
    let source = dir.join(format!("{name}.c"));
    std::fs::write(&source, text).unwrap();
    let built = dir.join(name);
    let cc = Command::new("cc")
        .arg(&source)
        .args(args)
        .arg("-o")
        .arg(&built)
        .output()
        .expect("run cc");
    assert!(
        cc.status.success(),
        "cc failed: {}",
        String::from_utf8_lossy(&cc.stderr)
    );
    built
}

/// Builds [`CU_INIT_C`] in `dir`.
fn cu_init_program(dir: &Path) -> PathBuf {
    build_c(dir, CU_INIT_C, "cu_init", &["-ldl"])
}

#[test]
fn the_missing_driver_is_reported_once() {
    let Some(shim) = common::shim() else {
        eprintln!("SKIPPED: the shim libcuda.so is not built beside {REMORA}");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let program = cu_init_program(dir.path());
    // Embedded (a server and its session worker, both without a driver) and a program that
    // connects: the reason reaches the user once.
    let missing = dir.path().join("no-driver/libcuda.so.1");
    let out = Command::new(REMORA)
        .args(["run", "--shim"])
        .arg(&shim)
        .arg(&program)
        .env("REMORA_REAL_LIBCUDA", &missing)
        .env_remove("REMORA_LOG")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("cuInit 100"), "{stdout}\n{stderr}");
    assert!(stderr.contains(&*missing.display().to_string()), "{stderr}");
    assert_eq!(
        stderr.matches("could not load the CUDA driver").count(),
        1,
        "{stderr}"
    );
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    // Not a terminal: no colour codes in the shim's log.
    assert!(!stderr.contains('\x1b'), "{stderr:?}");
}

/// `remora run --profile`: the program prints its calls by procedure at exit, and the
/// embedded server logs its own table.
#[test]
fn run_profile_prints_both_tables() {
    let Some(shim) = common::shim() else {
        eprintln!("SKIPPED: the shim libcuda.so is not built beside {REMORA}");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let program = cu_init_program(dir.path());
    let out = Command::new(REMORA)
        .args([
            "run",
            "--profile",
            "--serve-arg=--backend=emulated",
            "--shim",
        ])
        .arg(&shim)
        .arg(&program)
        .arg("retain")
        .env_remove("REMORA_LOG")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("cuInit 0\ncuDevicePrimaryCtxRetain 0"),
        "{stdout}\n{stderr}"
    );
    let row = stderr
        .lines()
        .find(|l| l.starts_with("rm_primary_ctx_retain "))
        .unwrap_or_else(|| panic!("no rm_primary_ctx_retain row: {stderr}"));
    assert_eq!(row.split_whitespace().nth(1), Some("1"), "{row}");
    let header = stderr
        .lines()
        .find(|l| l.starts_with("remora client profile: "))
        .unwrap_or_else(|| panic!("no client profile: {stderr}"));
    let calls: u64 = header["remora client profile: ".len()..]
        .split(' ')
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{header}"));
    assert!(calls > 0, "{stderr}");
    assert!(stderr.contains("ONC RPC server profile:"), "{stderr}");
    assert!(stderr.contains("REMORA_HELLO"), "{stderr}");
}

/// A driver whose `cuInit` answers `CUDA_ERROR_MPS_CONNECTION_FAILED`, as one does while an
/// MPS server starts or stops.
const MPS_DOWN_DRIVER: &str = r#"
int cuInit(unsigned flags) { (void)flags; return 805; }
int cuDriverGetVersion(int *v) { *v = 13000; return 0; }
"#;

/// A standing server's warm workers started while the driver could not initialise withdraw
/// (they would hand every later session that moment's failure): a session gets a worker
/// started for it, which tries the driver then, and the program is told why it has no GPU.
/// The program's own exit, with waits traced, prints no panic.
#[test]
fn warm_workers_whose_driver_failed_withdraw() {
    let Some(shim) = common::shim() else {
        eprintln!("SKIPPED: the shim libcuda.so is not built beside {REMORA}");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let driver = build_c(
        dir.path(),
        MPS_DOWN_DRIVER,
        "libcuda.so.1",
        &["-shared", "-fPIC"],
    );
    let socket = dir.path().join("s.sock");
    let mut serve = Command::new(REMORA);
    serve
        .args(["serve", "--warm-workers", "2", "--listen"])
        .arg(format!("unix://{}", socket.display()))
        .env("REMORA_REAL_LIBCUDA", &driver)
        .env("REMORA_LOG", "info,remora_server::worker_pool=debug");
    let log = dir.path().join("serve.log");
    let served = common::Served::start(serve, &log);
    let withdrawn = || {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .matches("failed to initialise in a warm session worker")
            .count()
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while withdrawn() < 2 {
        assert!(
            Instant::now() < deadline,
            "the warm workers did not withdraw: {}",
            std::fs::read_to_string(&log).unwrap()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = Command::new(REMORA)
        .args(["bench", "gpu-worker", "launch", "--driver"])
        .arg(&shim)
        .env("REMORA_SERVER", served.endpoint.to_string())
        .env("REMORA_TRANSPORT", "shm")
        .env("REMORA_WAIT_TRACE", "1")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("cuInit failed with CUDA error 100")
            && stderr.contains("CUDA_ERROR_MPS_CONNECTION_FAILED"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
    let deadline = Instant::now() + Duration::from_secs(10);
    let log_text = loop {
        let text = std::fs::read_to_string(&log).unwrap();
        if text.contains("session worker finished") || Instant::now() > deadline {
            break text;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(
        log_text.contains("a warm session worker had withdrawn; not used")
            && log_text.contains("session handed to a worker")
            && log_text.contains("session worker finished"),
        "{log_text}"
    );
    assert!(!log_text.contains("had exited; not used"), "{log_text}");
}
