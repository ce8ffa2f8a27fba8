//! End-to-end tests of the `remora` binary: serve, info, rpcgen, run, and their errors.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const REMORA: &str = env!("CARGO_BIN_EXE_remora");

/// A `remora serve` child process; killed on drop.
struct Serve {
    child: Child,
    endpoints: Vec<String>,
    /// The rest of its standard output.
    stdout: BufReader<std::process::ChildStdout>,
}

impl Serve {
    fn start(listen: &[&str]) -> Serve {
        let mut cmd = Command::new(REMORA);
        cmd.arg("serve")
            .env("REMORA_REAL_LIBCUDA", "/nonexistent/libcuda.so.1");
        for l in listen {
            cmd.args(["--listen", l]);
        }
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut reader = BufReader::new(child.stdout.take().unwrap());
        let mut endpoints = Vec::new();
        while endpoints.len() < listen.len() {
            let mut line = String::new();
            assert!(
                reader.read_line(&mut line).unwrap() > 0,
                "serve exited early"
            );
            if let Some(url) = line.trim().strip_prefix("remora serve: listening on ") {
                endpoints.push(url.to_owned());
            }
        }
        Serve {
            child,
            endpoints,
            stdout: reader,
        }
    }

    /// SIGTERM, then waits (at most 20 s) for the server to exit; its status and the rest of
    /// its standard output.
    fn terminate(mut self) -> (std::process::ExitStatus, String) {
        let pid = self.child.id().to_string();
        Command::new("kill").args(["-TERM", &pid]).status().unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                let mut rest = String::new();
                std::io::Read::read_to_string(&mut self.stdout, &mut rest).unwrap();
                return (status, rest);
            }
            assert!(Instant::now() < deadline, "serve did not stop on SIGTERM");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn info(url: &str) -> std::process::Output {
    Command::new(REMORA)
        .args(["info", "--server", url])
        .output()
        .unwrap()
}

#[test]
fn serve_answers_info_on_unix_and_tcp_and_stops_on_sigterm() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("remora.sock");
    let unix = format!("unix://{}", sock.display());
    let serve = Serve::start(&[&unix, "tcp://127.0.0.1:0"]);
    assert_eq!(serve.endpoints[0], unix);
    assert!(
        serve.endpoints[1].starts_with("tcp://127.0.0.1:"),
        "{:?}",
        serve.endpoints
    );
    assert!(
        !serve.endpoints[1].ends_with(":0"),
        "port 0 must be resolved"
    );
    for url in serve.endpoints.clone() {
        let out = info(&url);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "info {url}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let revision = format!(
            "protocol revision {}",
            remora_proto::remora::REMORA_PROTOCOL_REVISION
        );
        assert!(stdout.contains(&revision), "{stdout}");
        assert!(stdout.contains(&format!("server        {url}")), "{stdout}");
        assert!(stdout.contains("capabilities  oneway"), "{stdout}");
        // No driver here: zero GPUs and the reason, naming the library it tried.
        assert!(
            stdout.contains("driver        none: could not load the CUDA driver"),
            "{stdout}"
        );
        assert!(stdout.contains("/nonexistent/libcuda.so.1"), "{stdout}");
        assert!(stdout.contains("GPUs          0"), "{stdout}");
    }
    let (status, rest) = serve.terminate();
    assert!(status.success(), "serve exited with {status}");
    assert!(!sock.exists(), "the socket file is removed on shutdown");
    // What `remora run` waits for before returning (not the process's exit).
    assert_eq!(rest, "remora serve: stopped\n");
}

#[test]
fn info_without_a_server_says_what_to_do() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("unix://{}", dir.path().join("none.sock").display());
    let out = info(&url);
    assert!(!out.status.success());
    assert_one_line_connect_error(&out.stderr, &url);
}

/// A connection that could not be made: one line naming the URL, the system's reason once,
/// and what to check.
fn assert_one_line_connect_error(stderr: &[u8], url: &str) {
    let stderr = String::from_utf8_lossy(stderr);
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.starts_with(&format!("remora: error: cannot connect to {url}: ")),
        "{stderr}"
    );
    assert_eq!(stderr.matches("(os error").count(), 1, "{stderr}");
    assert!(
        stderr.contains("check that `remora serve` is running there"),
        "{stderr}"
    );
}

#[test]
fn serve_rejects_a_bad_url_with_the_expected_forms() {
    let out = Command::new(REMORA)
        .args(["serve", "--listen", "127.0.0.1:80"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("tcp://") && stderr.contains("unix://"),
        "{stderr}"
    );
}

#[test]
fn serve_rejects_a_malformed_device_list() {
    let out = Command::new(REMORA)
        .args(["serve", "--devices", "x"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--devices"));
}

/// Runs `remora rpcgen X -o OUT`.
fn rpcgen(x: &Path, out: &Path) -> std::process::Output {
    Command::new(REMORA)
        .arg("rpcgen")
        .arg(x)
        .arg("-o")
        .arg(out)
        .output()
        .unwrap()
}

#[test]
fn rpcgen_writes_a_crate_and_protects_foreign_directories() {
    let dir = tempfile::tempdir().unwrap();
    let x = dir.path().join("calc.x");
    std::fs::write(
        &x,
        "struct pair { int a; int b; };\n\
         program CALC_PROG { version CALC_V1 { int ADD(pair) = 1; } = 1; } = 0x20000099;\n",
    )
    .unwrap();
    let out_dir = dir.path().join("calc");
    let out = rpcgen(&x, &out_dir);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let cargo_toml = std::fs::read_to_string(out_dir.join("Cargo.toml")).unwrap();
    assert!(cargo_toml.contains("remora-oncrpc"), "{cargo_toml}");
    let lib = std::fs::read_to_string(out_dir.join("src/lib.rs")).unwrap();
    assert!(lib.contains("pub struct Pair"), "{lib}");
    assert!(lib.contains("CalcV1Client"), "{lib}");
    // Regenerating over our own output is fine.
    let again = rpcgen(&x, &out_dir);
    assert!(
        again.status.success(),
        "{}",
        String::from_utf8_lossy(&again.stderr)
    );
    // A directory with someone else's files is refused, and nothing in it is touched.
    let foreign = dir.path().join("foreign");
    std::fs::create_dir(&foreign).unwrap();
    std::fs::write(foreign.join("notes.txt"), "mine").unwrap();
    let out = rpcgen(&x, &foreign);
    assert!(!out.status.success());
    assert_eq!(
        std::fs::read_to_string(foreign.join("notes.txt")).unwrap(),
        "mine"
    );
    assert!(!Path::new(&foreign.join("Cargo.toml")).exists());
}

#[test]
fn rpcgen_reports_spec_errors_with_position() {
    let dir = tempfile::tempdir().unwrap();
    let x = dir.path().join("bad.x");
    std::fs::write(&x, "struct s {\n  int a\n};\n").unwrap();
    let out = rpcgen(&x, &dir.path().join("o"));
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("bad.x:3:1"), "{stderr}");
}

/// `remora serve` with no --listen, its runtime directory at `runtime`, and no driver.
fn serve_in(runtime: &Path) -> Command {
    let mut cmd = Command::new(REMORA);
    cmd.arg("serve")
        .env("XDG_RUNTIME_DIR", runtime)
        .env("REMORA_REAL_LIBCUDA", "/nonexistent/libcuda.so.1");
    cmd
}

#[test]
fn default_listener_is_a_private_unix_socket_in_the_runtime_dir() {
    use std::os::unix::fs::PermissionsExt;
    let runtime = tempfile::tempdir().unwrap();
    let mut child = serve_in(runtime.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let sock = runtime.path().join("remora/remora.sock");
    assert_eq!(
        line.trim(),
        format!("remora serve: listening on unix://{}", sock.display())
    );
    let mode = std::fs::metadata(runtime.path().join("remora"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o700);
    let out = Command::new(REMORA)
        .arg("info")
        .env("XDG_RUNTIME_DIR", runtime.path())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let _ = child.kill();
    let _ = child.wait();
}

#[test]
fn a_default_socket_dir_open_to_others_is_refused() {
    use std::os::unix::fs::PermissionsExt;
    let runtime = tempfile::tempdir().unwrap();
    let dir = runtime.path().join("remora");
    std::fs::create_dir(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    let out = Command::new(REMORA)
        .arg("serve")
        .env("XDG_RUNTIME_DIR", runtime.path())
        .env("REMORA_REAL_LIBCUDA", "/nonexistent/libcuda.so.1")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("mode 0700") && stderr.contains("--listen"),
        "{stderr}"
    );
}

#[test]
fn bench_null_measures_round_trips_and_writes_json() {
    let dir = tempfile::tempdir().unwrap();
    let unix = format!("unix://{}", dir.path().join("remora.sock").display());
    let serve = Serve::start(&[&unix, "tcp://127.0.0.1:0"]);
    let (unix_url, tcp_url) = (serve.endpoints[0].clone(), serve.endpoints[1].clone());
    for (url, transport) in [(&unix_url, "shm"), (&unix_url, "unix"), (&tcp_url, "tcp")] {
        let json = dir.path().join(format!("null-{transport}.json"));
        let out = Command::new(REMORA)
            .args([
                "bench",
                "null",
                "--calls",
                "200",
                "--transport",
                transport,
                "--server",
                url,
                "--json",
            ])
            .arg(&json)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "bench null {url} {transport}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            stdout.contains(&format!("NULL round trip to {url} over {transport}: p50 ")),
            "{stdout}"
        );
        let text = std::fs::read_to_string(&json).unwrap();
        assert!(text.contains("\"calls\": 200,"), "{text}");
        assert!(
            text.contains(&format!("\"transport\": \"{transport}\",")),
            "{text}"
        );
        let p50: f64 = text
            .lines()
            .find_map(|l| l.trim().strip_prefix("\"p50_us\": "))
            .and_then(|v| v.trim_end_matches(',').parse().ok())
            .unwrap();
        assert!(p50 > 0.0 && p50 < 1e6, "{text}");
    }
    // Shared memory cannot be had over TCP: a clear error.
    let out = Command::new(REMORA)
        .args([
            "bench",
            "null",
            "--calls",
            "1",
            "--transport",
            "shm",
            "--server",
        ])
        .arg(&tcp_url)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("--transport shm needs a server on this host"),
        "{stderr}"
    );
    // No server: a clear error, not a hang.
    let none = format!("unix://{}", dir.path().join("none.sock").display());
    let out = Command::new(REMORA)
        .args(["bench", "null", "--calls", "1", "--server", &none])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert_one_line_connect_error(&out.stderr, &none);
}

/// `remora run ARGS…` with an embedded server (no driver needed: the programs below do not
/// load the shim, so any existing file stands in for it).
fn remora_run(args: &[&str]) -> std::process::Output {
    Command::new(REMORA)
        .args(["run", "--shim", REMORA])
        .args(args)
        .env("REMORA_REAL_LIBCUDA", "/nonexistent/libcuda.so.1")
        .output()
        .unwrap()
}

#[test]
fn run_takes_the_program_with_or_without_double_dash() {
    let dir = tempfile::tempdir().unwrap();
    let out_file = dir.path().join("args");
    let script = format!("printf '%s,' \"$@\" > {}; exit 3", out_file.display());
    for dash in [false, true] {
        let mut args = vec![];
        if dash {
            args.push("--");
        }
        args.extend(["sh", "-c", &script, "sh", "--flag", "--", "x"]);
        let out = remora_run(&args);
        assert_eq!(
            out.status.code(),
            Some(3),
            "the program's exit status (-- {dash}): {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(
            std::fs::read_to_string(&out_file).unwrap(),
            "--flag,--,x,",
            "-- {dash}"
        );
        std::fs::remove_file(&out_file).unwrap();
    }
}

#[test]
fn run_against_a_dead_server_fails_fast_without_starting_the_program() {
    let dir = tempfile::tempdir().unwrap();
    let marker = dir.path().join("ran");
    let touch = format!("touch {}", marker.display());
    let refused = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("tcp://{}", listener.local_addr().unwrap())
    };
    for url in ["unix:///nonexistent", &refused] {
        let started = Instant::now();
        let out = Command::new(REMORA)
            .args(["run", "--server", url, "--", "sh", "-c", &touch])
            .output()
            .unwrap();
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{url}: took {:?}",
            started.elapsed()
        );
        assert!(!out.status.success(), "{url}");
        assert_one_line_connect_error(&out.stderr, url);
        assert!(!marker.exists(), "{url}: the program ran");
    }
    // A server that answers: the program runs.
    let sock = format!("unix://{}", dir.path().join("remora.sock").display());
    let serve = Serve::start(&[&sock]);
    let out = remora_run(&["--server", &serve.endpoints[0], "sh", "-c", &touch]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(marker.exists());
}

/// `remora serve EXTRA --listen unix://SOCK` with no driver to load (standard error piped, the
/// log at `log` or the default), once it has printed that it listens.
fn serve_without_driver(sock: &Path, extra: &[&str], log: Option<&str>) -> std::process::Child {
    let mut cmd = Command::new(REMORA);
    cmd.arg("serve")
        .args(extra)
        .arg("--listen")
        .arg(format!("unix://{}", sock.display()))
        .env("REMORA_REAL_LIBCUDA", "/nonexistent/libcuda.so.1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    match log {
        Some(l) => cmd.env("REMORA_LOG", l),
        None => cmd.env_remove("REMORA_LOG"),
    };
    let mut child = cmd.spawn().unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert!(line.contains("listening on"), "{line}");
    child
}

#[test]
fn the_log_has_no_colour_codes_when_stderr_is_not_a_terminal() {
    let dir = tempfile::tempdir().unwrap();
    let child = serve_without_driver(&dir.path().join("remora.sock"), &[], None);
    let pid = child.id().to_string();
    Command::new("kill").args(["-TERM", &pid]).status().unwrap();
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("serving zero GPUs"), "{stderr}");
    assert!(!stderr.contains('\x1b'), "{stderr:?}");
}

#[test]
fn no_driver_probe_leaves_the_gpus_to_the_workers() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("remora.sock");
    let child = serve_without_driver(&sock, &["--no-driver-probe"], Some("info"));
    // A session's worker still probes its own driver and reports what it found.
    let out = Command::new(REMORA)
        .args(["info", "--server"])
        .arg(format!("unix://{}", sock.display()))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert!(stdout.contains("GPUs          0"), "{stdout}");
    assert!(
        stdout.contains("driver        none: could not load the CUDA driver"),
        "{stdout}"
    );
    Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{:?}", out.status);
    // The accepting process never loaded the driver: no inventory of its own in the log.
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("serving zero GPUs"), "{stderr}");
    assert!(!stderr.contains("driver probed"), "{stderr}");
}

#[test]
fn version_names_the_build_commit_and_whether_the_sources_differed() {
    let out = Command::new(REMORA).arg("--version").output().unwrap();
    assert!(out.status.success());
    let line = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let rest = line.strip_prefix("remora ").expect(&line);
    let (version, commit) = match rest.split_once(' ') {
        Some((v, c)) => (v, Some(c)),
        None => (rest, None),
    };
    assert_eq!(version, env!("CARGO_PKG_VERSION"), "{line}");
    // Outside a git checkout there is no commit; inside, "(abc1234)" or "(abc1234+dirty)".
    if let Some(c) = commit {
        let c = c
            .strip_prefix('(')
            .and_then(|c| c.strip_suffix(')'))
            .expect(&line);
        let hash = c.strip_suffix("+dirty").unwrap_or(c);
        assert!(
            hash.len() >= 7 && hash.bytes().all(|b| b.is_ascii_hexdigit()),
            "{line}"
        );
    }
}
