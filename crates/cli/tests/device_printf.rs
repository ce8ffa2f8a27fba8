//! Device-side printf output reaches the client's standard output (emulated backend, no GPU).
//!
//! `remora serve --backend emulated --isolation process` with the test hook
//! `REMORA_EMULATED_DEVICE_PRINTF` set: every context or stream synchronize in a session
//! worker writes that text to the worker's fd 1, as NVIDIA's driver writes a kernel's printf
//! output. The worker captures it and returns it in the synchronizing reply; the client writes
//! it to its own fd 1 before the call returns, in order with the program's own output.

mod common;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use remora_oncrpc::{Client, Endpoint};
use remora_proto::remora::*;

const REMORA: &str = env!("CARGO_BIN_EXE_remora");
const DEVICE_TEXT: &str = "device says hello from the emulated kernel\n";
/// Set in the re-executed test binary that plays the CUDA program.
const CLIENT_MODE: &str = "REMORA_TEST_DEVICE_PRINTF_CLIENT";

struct Serve {
    child: Child,
    endpoint: Endpoint,
}

impl Serve {
    fn start(dir: &Path, isolation: &str) -> Serve {
        let sock = dir.join("remora.sock");
        let mut child = Command::new(REMORA)
            .args(["serve", "--backend", "emulated", "--isolation", isolation])
            .arg("--listen")
            .arg(format!("unix://{}", sock.display()))
            .env("TMPDIR", dir)
            .env("REMORA_LOG", "info")
            .env(remora_server::EMULATED_DEVICE_PRINTF_ENV, DEVICE_TEXT)
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(dir.join("serve.log")).unwrap())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert!(line.contains("listening on"), "{line}");
        Serve {
            child,
            endpoint: Endpoint::Unix(sock),
        }
    }

    /// A protocol client that said HELLO speaking revisions up to `max_revision`.
    fn client(&self, max_revision: u32) -> RemoraV1Client {
        let c = RemoraV1Client::new(Client::connect(&self.endpoint).unwrap())
            .with_timeout(Duration::from_secs(20));
        let reply = c
            .remora_hello(&HelloArgs {
                min_revision: 2,
                max_revision,
                client_name: "device_printf test".into(),
                capabilities: u64::from(REMORA_CAP_ONEWAY),
            })
            .unwrap();
        let HelloReply::True(w) = reply else {
            panic!("HELLO refused: {reply:?}")
        };
        assert_eq!(w.revision, max_revision);
        c
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

fn device_output(reply: &RmSyncReply) -> Vec<u8> {
    reply
        .copies
        .iter()
        .filter(|c| c.copy_id == RM_DEVICE_OUTPUT_ID)
        .flat_map(|c| c.data.iter().copied())
        .collect()
}

#[test]
fn synchronizing_replies_carry_the_workers_device_output_to_revision_4_clients() {
    let dir = tempfile::tempdir().unwrap();
    let serve = Serve::start(dir.path(), "process");

    let c = serve.client(REMORA_PROTOCOL_REVISION);
    let ctx = primary(&c);
    let r = c.rm_ctx_synchronize(&ctx).unwrap();
    assert_eq!(r.status, 0);
    assert_eq!(device_output(&r), DEVICE_TEXT.as_bytes());
    let r = c
        .rm_stream_synchronize(&RmStreamArgs {
            ctx,
            stream: u64::from(RM_STREAM_LEGACY),
        })
        .unwrap();
    assert_eq!(device_output(&r), DEVICE_TEXT.as_bytes());
    // Delivered once: nothing is left to take.
    assert!(c.rm_device_output_take().unwrap().is_empty());
    // A copy of the client's own may not use the reserved id: the error is deferred.
    let RmU64Reply::Case0(ptr) = c
        .rm_mem_alloc(&RmAllocArgs {
            ctx,
            bytesize: 4096,
        })
        .unwrap()
    else {
        panic!("no allocation")
    };
    c.rm_memcpy_dtoh_async(&RmDtohArgs {
        ctx,
        stream: u64::from(RM_STREAM_LEGACY),
        src: ptr,
        size: 16,
        copy_id: RM_DEVICE_OUTPUT_ID,
    })
    .unwrap();
    let r = c
        .rm_stream_query(&RmStreamArgs {
            ctx,
            stream: u64::from(RM_STREAM_LEGACY),
        })
        .unwrap();
    assert_eq!(r.status, 1, "CUDA_ERROR_INVALID_VALUE");
    assert!(device_output(&r).is_empty());

    // A revision-3 session gets no such entry (its output goes to the worker's own stdout).
    let old = serve.client(3);
    let ctx = primary(&old);
    let r = old.rm_ctx_synchronize(&ctx).unwrap();
    assert_eq!(r.status, 0);
    assert!(r.copies.is_empty(), "{r:?}");
}

#[test]
fn thread_isolation_keeps_device_output_on_the_server() {
    let dir = tempfile::tempdir().unwrap();
    let serve = Serve::start(dir.path(), "thread");
    let c = serve.client(REMORA_PROTOCOL_REVISION);
    let ctx = primary(&c);
    let r = c.rm_ctx_synchronize(&ctx).unwrap();
    assert_eq!(r.status, 0);
    assert!(r.copies.is_empty(), "{r:?}");
    drop(serve);
    let log = std::fs::read_to_string(dir.path().join("serve.log")).unwrap();
    assert!(
        log.contains("device-side printf output is not delivered to clients"),
        "{log}"
    );
}

/// The program under test, when this binary is re-executed with [`CLIENT_MODE`]: host lines
/// around synchronizing calls, each of which brings the device text.
fn act_as_client(server: &str) {
    use std::io::Write;
    let client = remora_client::Client::connect(server).unwrap();
    let device = client.device(0).unwrap();
    let ctx = remora_client::Context::new(&device).unwrap();
    let stream = remora_client::Stream::new(&ctx).unwrap();
    let mut out = std::io::stdout();
    writeln!(out, "host before").unwrap();
    out.flush().unwrap();
    ctx.synchronize().unwrap();
    writeln!(out, "host between").unwrap();
    out.flush().unwrap();
    stream.synchronize().unwrap();
    writeln!(out, "host after").unwrap();
    out.flush().unwrap();
}

#[test]
fn device_output_reaches_the_client_stdout_in_order_with_its_own() {
    if let Ok(server) = std::env::var(CLIENT_MODE) {
        act_as_client(&server);
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let serve = Serve::start(dir.path(), "process");
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "device_output_reaches_the_client_stdout_in_order_with_its_own",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CLIENT_MODE, serve.endpoint.to_string())
        .stderr(Stdio::inherit())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    let expected = format!("host before\n{DEVICE_TEXT}host between\n{DEVICE_TEXT}host after\n");
    assert!(
        stdout.contains(&expected),
        "stdout of the client:\n{stdout}\nexpected, in order:\n{expected}"
    );
}

/// The CUDA headers (scripts/test sets REMORA_CUDA_INCLUDE) and the shim built beside the
/// binary; `None` (with the reason printed) when missing.
fn c_toolchain() -> Option<(std::path::PathBuf, std::path::PathBuf)> {
    let Some(include) = std::env::var_os("REMORA_CUDA_INCLUDE")
        .map(std::path::PathBuf::from)
        .filter(|d| d.join("cuda.h").is_file())
    else {
        eprintln!("SKIPPED: no CUDA 13.0 headers (set REMORA_CUDA_INCLUDE; scripts/test does)");
        return None;
    };
    let target = Path::new(REMORA).parent().unwrap();
    let Some(shim) = common::shim() else {
        eprintln!(
            "SKIPPED: the shim libcuda.so is not built in {}",
            target.display()
        );
        return None;
    };
    Some((include, shim))
}

#[test]
fn a_driver_program_gets_device_output_on_its_stdout_through_the_shim() {
    let Some((include, shim)) = c_toolchain() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let program = dir.path().join("device_printf");
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/c/device_printf.c");
    let cc = Command::new("cc")
        .arg("-I")
        .arg(&include)
        .arg(&source)
        .arg("-L")
        .arg(shim.parent().unwrap())
        .args(["-lcuda", "-o"])
        .arg(&program)
        .output()
        .expect("run cc");
    assert!(
        cc.status.success(),
        "cc failed: {}",
        String::from_utf8_lossy(&cc.stderr)
    );
    let serve = Serve::start(dir.path(), "process");
    let out = Command::new(REMORA)
        .args(["run", "--server"])
        .arg(serve.endpoint.to_string())
        .arg("--shim")
        .arg(&shim)
        .arg("--")
        .arg(&program)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "exit {}\nstdout:\n{stdout}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let expected = format!("host before\n{DEVICE_TEXT}host between\n{DEVICE_TEXT}host after\n");
    assert_eq!(stdout, expected);
}
