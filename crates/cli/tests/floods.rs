//! Issue 13, "done when": under an 8 GiB address-space limit, `remora serve` (emulated backend)
//! survives the floods of the findings at once, its memory stays bounded, and it keeps
//! serving another client. Floods: idle connections past the per-peer cap, large partial
//! records (the record budget), slow trickling records, and one-way asynchronous
//! device-to-host copies that are never synchronized (`--max-pending-copy-bytes`).

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use remora_oncrpc::{Client, Endpoint};
use remora_proto::remora::*;

const REMORA: &str = env!("CARGO_BIN_EXE_remora");
/// The address-space limit the server runs under.
const ADDRESS_SPACE_KIB: u64 = 8 << 20;
/// Its peak resident memory must stay below this.
const RSS_BOUND: u64 = 2 << 30;
const PENDING: u64 = 128 << 20;

struct Serve {
    child: Child,
}

impl Drop for Serve {
    fn drop(&mut self) {
        if let Ok(Some(status)) = self.child.try_wait() {
            eprintln!("the server had exited: {status}");
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Peak resident memory of `pid`, from /proc.
fn peak_rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM in /proc/PID/status");
    kib << 10
}

fn client(endpoint: &Endpoint) -> RemoraV1Client {
    RemoraV1Client::new(Client::connect(endpoint).unwrap()).with_timeout(Duration::from_secs(30))
}

#[test]
fn the_server_survives_every_flood_at_once_within_bounded_memory() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let tcp: Endpoint = format!("tcp://127.0.0.1:{port}").parse().unwrap();
    let unix = Endpoint::Unix(dir.path().join("remora.sock"));
    // `ulimit -v` through the shell: the server itself runs unchanged.
    let mut child = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "ulimit -v {ADDRESS_SPACE_KIB} && exec \"$0\" serve --backend emulated --isolation thread --listen {unix} --listen {tcp} --max-pending-copy-bytes {PENDING}"
        ))
        .arg(REMORA)
        .env("REMORA_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(dir.path().join("serve.log")).unwrap())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert!(line.contains("listening on"), "{line}");
    // The reader is gone now, before the second listener's line: the server must not die of
    // the closed pipe (it did once, which this test found).
    let serve = Serve { child };
    let pid = serve.child.id();

    let floods = vec![
        // 300 idle connections from one peer: past the per-peer cap of 128.
        std::thread::spawn({
            let tcp = tcp.clone();
            move || {
                let Endpoint::Tcp(addr) = &tcp else {
                    unreachable!()
                };
                let held: Vec<TcpStream> = (0..300)
                    .filter_map(|_| TcpStream::connect(addr).ok())
                    .collect();
                std::thread::sleep(Duration::from_secs(3));
                drop(held);
            }
        }),
        // Eight 96 MiB records, 64 MiB of each sent: the record budget.
        std::thread::spawn({
            let unix = unix.clone();
            move || {
                let Endpoint::Unix(path) = &unix else {
                    unreachable!()
                };
                let conns: Vec<_> = (0..8)
                    .map(|_| {
                        let path = path.clone();
                        std::thread::spawn(move || {
                            let mut s = std::os::unix::net::UnixStream::connect(&path).unwrap();
                            s.set_write_timeout(Some(Duration::from_secs(2))).unwrap();
                            // A first call (NULL-sized HELLO stand-in) is not needed: the
                            // first record's limit is 64 KiB, so send a small valid call
                            // first, then the large one.
                            let null = null_call(1);
                            let _ = s.write_all(&null);
                            let _ = s.write_all(&(((96u32 << 20) | 0x8000_0000).to_be_bytes()));
                            let chunk = vec![0u8; 1 << 20];
                            for _ in 0..64 {
                                if s.write_all(&chunk).is_err() {
                                    break;
                                }
                            }
                            std::thread::sleep(Duration::from_secs(2));
                        })
                    })
                    .collect();
                for c in conns {
                    let _ = c.join();
                }
            }
        }),
        // Twenty trickling records: a header, then a byte a second.
        std::thread::spawn({
            let tcp = tcp.clone();
            move || {
                let Endpoint::Tcp(addr) = &tcp else {
                    unreachable!()
                };
                let mut conns: Vec<TcpStream> = (0..20)
                    .filter_map(|_| TcpStream::connect(addr).ok())
                    .collect();
                for _ in 0..3 {
                    for c in &mut conns {
                        let _ = c.write_all(&[0x80]);
                    }
                    std::thread::sleep(Duration::from_secs(1));
                }
            }
        }),
        // 64 one-way 64 MiB device-to-host copies, never synchronized.
        std::thread::spawn({
            let unix = unix.clone();
            move || {
                let c = client(&unix);
                let RmHandleReply::Case0(ctx) = c.rm_primary_ctx_retain(&0).unwrap() else {
                    panic!("no context")
                };
                let RmU64Reply::Case0(src) = c
                    .rm_mem_alloc(&RmAllocArgs {
                        ctx,
                        bytesize: 64 << 20,
                    })
                    .unwrap()
                else {
                    panic!("no device memory")
                };
                for copy_id in 1..=64 {
                    c.rm_memcpy_dtoh_async(&RmDtohArgs {
                        ctx,
                        stream: 0,
                        src,
                        size: 64 << 20,
                        copy_id,
                    })
                    .unwrap();
                }
                let r = c.rm_ctx_synchronize(&ctx).unwrap();
                assert_eq!(r.status, 2, "the flood's copies past the bound are refused");
            }
        }),
    ];

    // Meanwhile another client is served.
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(4) {
        let c = client(&unix);
        assert!(matches!(
            c.rm_device_get_count().unwrap(),
            RmIntReply::Case0(1)
        ));
        std::thread::sleep(Duration::from_millis(200));
    }
    for f in floods {
        f.join().unwrap();
    }
    let c = client(&unix);
    assert!(matches!(
        c.rm_device_get_count().unwrap(),
        RmIntReply::Case0(1)
    ));
    let peak = peak_rss(pid);
    eprintln!("server peak RSS {} MiB", peak >> 20);
    assert!(
        peak < RSS_BOUND,
        "the server's peak resident memory was {} MiB",
        peak >> 20
    );
}

/// A whole NULL call record of the Remora program.
fn null_call(xid: u32) -> Vec<u8> {
    let words = [xid, 0, 2, REMORA_PROG, REMORA_V1, 0, 0, 0, 0, 0];
    let mut out = ((words.len() as u32 * 4) | 0x8000_0000)
        .to_be_bytes()
        .to_vec();
    for w in words {
        out.extend_from_slice(&w.to_be_bytes());
    }
    out
}
