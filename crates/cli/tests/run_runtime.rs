//! Unmodified CUDA *runtime* programs through `remora run`, on a machine without a GPU: built by
//! the wheel's nvcc with the default static cudart and with `-cudart shared`, they run on the
//! emulated test backend (`--serve-arg=--backend --serve-arg=emulated`) through the runtime's
//! private export tables, and on a server with no driver they get cudaErrorNoDevice.
//!
//! Needs nvcc and cudart from NVIDIA's CUDA 13.0 wheels (scripts/test installs them and sets
//! REMORA_CUDA_HOME) and the shim built in the same target directory; otherwise each test
//! prints why it skipped.

mod common;

use common::shim;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const REMORA: &str = env!("CARGO_BIN_EXE_remora");

/// The wheel's `nvidia/cu13` directory (bin/nvcc, lib/libcudart*).
fn cuda_home() -> Option<PathBuf> {
    let home = std::env::var_os("REMORA_CUDA_HOME")
        .map(PathBuf::from)
        .or_else(|| {
            let inc = PathBuf::from(std::env::var_os("REMORA_CUDA_INCLUDE")?);
            Some(inc.parent()?.to_path_buf())
        })?;
    let ok = home.join("bin/nvcc").is_file() && home.join("lib/libcudart.so.13").is_file();
    ok.then_some(home)
}

#[derive(Clone, Copy, Debug)]
enum Cudart {
    Static,
    Shared,
}

/// Builds `tests/cuda/NAME.cu` with the wheel's nvcc.
fn build(cuda: &Path, dir: &Path, name: &str, cudart: Cudart) -> PathBuf {
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("../../tests/cuda/{name}.cu"));
    let out = dir.join(format!("{name}_{cudart:?}"));
    let lib = cuda.join("lib");
    let mut cmd = Command::new(cuda.join("bin/nvcc"));
    cmd.args(["-arch=sm_90", "-o"]).arg(&out).arg(&source);
    cmd.arg(format!("-L{}", lib.display()));
    if let Cudart::Shared = cudart {
        cmd.args(["-cudart", "none", "-l:libcudart.so.13", "-Xlinker"])
            .arg(format!("-rpath={}", lib.display()));
    }
    let r = cmd.output().expect("run nvcc");
    assert!(
        r.status.success(),
        "nvcc failed for {name} ({cudart:?}): {}",
        String::from_utf8_lossy(&r.stderr)
    );
    out
}

/// Runs `program` under `remora run` with an embedded server given `serve_args`.
fn run(shim: &Path, program: &Path, serve_args: &[&str]) -> Output {
    run_over(shim, program, serve_args, "auto")
}

/// [`run`] with `--transport TRANSPORT`.
fn run_over(shim: &Path, program: &Path, serve_args: &[&str], transport: &str) -> Output {
    let mut cmd = Command::new(REMORA);
    cmd.args(["run", "--transport", transport, "--shim"])
        .arg(shim);
    for a in serve_args {
        cmd.arg(format!("--serve-arg={a}"));
    }
    let mut child = cmd
        .arg("--")
        .arg(program)
        .env("REMORA_REAL_LIBCUDA", "/nonexistent/libcuda.so.1")
        .env("REMORA_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if child.try_wait().unwrap().is_some() {
            break;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("{} hung under remora run", program.display());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

fn setup() -> Option<(PathBuf, PathBuf)> {
    let Some(cuda) = cuda_home() else {
        eprintln!(
            "SKIPPED: no nvcc/cudart from the CUDA 13.0 wheels (set REMORA_CUDA_HOME; scripts/test does)"
        );
        return None;
    };
    let Some(shim) = shim() else {
        eprintln!("SKIPPED: the shim libcuda.so is not built beside {REMORA}");
        return None;
    };
    Some((cuda, shim))
}

const EMULATED: [&str; 2] = ["--backend", "emulated"];

#[test]
fn runtime_program_without_kernels_works_on_the_emulated_backend() {
    let Some((cuda, shim)) = setup() else { return };
    let dir = tempfile::tempdir().unwrap();
    let memory = remora_server::EmulatedConfig::default().memory_per_device;
    for cudart in [Cudart::Static, Cudart::Shared] {
        let program = build(&cuda, dir.path(), "runtime_nokernel", cudart);
        let out = run(&shim, &program, &EMULATED);
        let (stdout, stderr) = text(&out);
        let ctx = format!("{cudart:?} cudart\nstdout:\n{stdout}\nstderr:\n{stderr}");
        assert!(out.status.success(), "exit {}: {ctx}", out.status);
        for line in [
            "cudaGetDeviceCount(&n) 0 cudaSuccess".to_string(),
            "device count 1".to_string(),
            "name Remora emulated device".to_string(),
            format!("totalGlobalMem {memory}"),
            "roundtrip equal".to_string(),
            "default d2h equal".to_string(),
            "memset mismatches 0".to_string(),
            "elapsed non-negative yes".to_string(),
            "async roundtrip equal".to_string(),
            "cudaDeviceSynchronize() 0 cudaSuccess".to_string(),
            "cudaFreeHost(host) 0 cudaSuccess".to_string(),
            "error string invalid argument".to_string(),
            "error name cudaErrorMemoryAllocation".to_string(),
            // cudaErrorInvalidValue: not an allocation of this client.
            "bad free 1".to_string(),
            "failures 0".to_string(),
        ] {
            assert!(stdout.lines().any(|l| l == line), "missing {line:?}: {ctx}");
        }
        // Every call the program checks printed its result, and none failed.
        assert!(
            stdout
                .lines()
                .filter(|l| l.starts_with("cuda"))
                .all(|l| l.ends_with(" 0 cudaSuccess")),
            "{ctx}"
        );
        assert!(!stderr.contains("panicked"), "{ctx}");
        assert!(!stderr.contains("Remora does not implement"), "{ctx}");
    }
}

#[test]
fn runtime_program_runs_over_every_transport() {
    let Some((cuda, shim)) = setup() else { return };
    let dir = tempfile::tempdir().unwrap();
    let program = build(&cuda, dir.path(), "runtime_nokernel", Cudart::Shared);
    // shm is forced: the program fails if its session is not in shared memory.
    for transport in ["shm", "unix", "tcp"] {
        let out = run_over(&shim, &program, &EMULATED, transport);
        let (stdout, stderr) = text(&out);
        let ctx = format!("{transport}\nstdout:\n{stdout}\nstderr:\n{stderr}");
        assert!(out.status.success(), "exit {}: {ctx}", out.status);
        assert!(stdout.lines().any(|l| l == "roundtrip equal"), "{ctx}");
        assert!(stdout.lines().any(|l| l == "failures 0"), "{ctx}");
        assert!(!stderr.contains("panicked"), "{ctx}");
    }
}

#[test]
fn runtime_kernel_registration_reaches_the_server_and_the_launch_fails_loudly() {
    let Some((cuda, shim)) = setup() else { return };
    let dir = tempfile::tempdir().unwrap();
    for cudart in [Cudart::Static, Cudart::Shared] {
        let program = build(&cuda, dir.path(), "runtime_kernel", cudart);
        let out = run(&shim, &program, &EMULATED);
        let (stdout, stderr) = text(&out);
        let ctx = format!("{cudart:?} cudart\nstdout:\n{stdout}\nstderr:\n{stderr}");
        assert!(out.status.success(), "exit {}: {ctx}", out.status);
        assert!(stdout.contains("malloc 0\n"), "{ctx}");
        // The runtime loaded its fatbin through cuLibraryLoadData (the server stored the
        // image); the emulated backend has no function for a real image, so the kernel
        // lookup is CUDA_ERROR_NOT_FOUND, which the runtime reports for the launch.
        assert!(
            stdout.contains("launch 500 cudaErrorSymbolNotFound\n"),
            "{ctx}"
        );
        assert!(!stdout.contains("launch 0 "), "{ctx}");
        assert!(!stderr.contains("panicked"), "{ctx}");
    }
}

#[test]
fn runtime_programs_get_no_device_from_a_server_without_a_driver() {
    let Some((cuda, shim)) = setup() else { return };
    let dir = tempfile::tempdir().unwrap();
    for cudart in [Cudart::Static, Cudart::Shared] {
        let program = build(&cuda, dir.path(), "runtime_nokernel", cudart);
        let out = run(&shim, &program, &[]);
        let (stdout, stderr) = text(&out);
        let ctx = format!("{cudart:?} cudart\nstdout:\n{stdout}\nstderr:\n{stderr}");
        // The program exits 2 after the failed cudaGetDeviceCount; not 35 (insufficient
        // driver), not 36 (newer driver needed), not a crash.
        assert_eq!(out.status.code(), Some(2), "{ctx}");
        assert!(
            stdout.contains("cudaGetDeviceCount(&n) 100 cudaErrorNoDevice"),
            "{ctx}"
        );
    }
}
