//! Issue 13 §2: limits per session and per tenant (`remora serve --tenants FILE`, `--limit`).
//! Past a limit a call gets CUDA_ERROR_OUT_OF_MEMORY and a `remora::audit` line; a tenant's
//! sessions are counted together; a session past the tenant's `sessions` is refused at
//! HELLO with the reason; freeing makes room again; other tenants are not affected. EMULATED
//! backend, thread isolation (process isolation: `crates/cli/tests/quotas.rs`).

use std::sync::Arc;
use std::time::Duration;

use remora_oncrpc::{Client, Endpoint};
use remora_proto::remora::*;
use remora_server::{
    Backend, EmulatedBackend, EmulatedConfig, Running, ServeConfig, inventory_of,
    start_with_backend,
};
use remora_xdr::Bytes;
use sha2::{Digest, Sha256};

const OUT_OF_MEMORY: i32 = 2;

fn serve(dir: &tempfile::TempDir, tenants: Option<&str>, limits: &[&str]) -> (Running, Endpoint) {
    let backend = Arc::new(EmulatedBackend::new(EmulatedConfig::default()));
    let endpoint = Endpoint::Unix(dir.path().join("remora.sock"));
    let tenants_file = tenants.map(|text| {
        let path = dir.path().join("tenants.toml");
        std::fs::write(&path, text).unwrap();
        path
    });
    let running = start_with_backend(
        ServeConfig {
            listen: vec![endpoint.clone(), "tcp://127.0.0.1:0".parse().unwrap()],
            tenants_file,
            limits: limits.iter().map(|s| s.to_string()).collect(),
            ..ServeConfig::default()
        },
        Arc::clone(&backend) as Arc<dyn Backend>,
        inventory_of(&*backend),
    )
    .unwrap();
    (running, endpoint)
}

fn client(endpoint: &Endpoint) -> RemoraV1Client {
    RemoraV1Client::new(Client::connect(endpoint).unwrap()).with_timeout(Duration::from_secs(20))
}

fn hello(c: &RemoraV1Client) -> HelloReply {
    c.remora_hello(&HelloArgs {
        min_revision: 1,
        max_revision: REMORA_PROTOCOL_REVISION,
        client_name: "quota test".into(),
        capabilities: u64::from(REMORA_CAP_ONEWAY),
    })
    .unwrap()
}

fn handle(r: RmHandleReply) -> Result<u64, i32> {
    match r {
        RmHandleReply::Case0(h) => Ok(h),
        RmHandleReply::Default { discriminant } => Err(discriminant),
    }
}

fn ctx(c: &RemoraV1Client) -> u64 {
    assert!(matches!(hello(c), HelloReply::True(_)));
    handle(c.rm_primary_ctx_retain(&0).unwrap()).unwrap()
}

fn alloc(c: &RemoraV1Client, ctx: u64, bytes: u64) -> Result<u64, i32> {
    match c
        .rm_mem_alloc(&RmAllocArgs {
            ctx,
            bytesize: bytes,
        })
        .unwrap()
    {
        RmU64Reply::Case0(p) => Ok(p),
        RmU64Reply::Default { discriminant } => Err(discriminant),
    }
}

fn stream(c: &RemoraV1Client, ctx: u64) -> Result<u64, i32> {
    handle(
        c.rm_stream_create(&RmStreamCreateArgs {
            ctx,
            flags: 1,
            priority: 0,
        })
        .unwrap(),
    )
}

fn event(c: &RemoraV1Client, ctx: u64) -> Result<u64, i32> {
    handle(
        c.rm_event_create(&RmHandleFlags {
            handle: ctx,
            flags: 0,
        })
        .unwrap(),
    )
}

fn load(c: &RemoraV1Client, ctx: u64, n: usize) -> RmLoadReply {
    let image = Bytes::from(format!("REMORA-EMU-MODULE\nfunc k{n} 8\n").into_bytes());
    let hash: [u8; 32] = Sha256::digest(&image).into();
    c.rm_module_load(&RmModuleLoadArgs { ctx, hash, image })
        .unwrap()
}

#[test]
fn session_limits_refuse_objects_and_memory_past_them_and_freeing_makes_room() {
    let dir = tempfile::tempdir().unwrap();
    let (running, endpoint) = serve(
        &dir,
        Some("[session]\nstreams = 2\nevents = 3\nmodules = 1\ndevice-memory = \"1MiB\"\n"),
        &["session.events=2"],
    );
    let c = client(&endpoint);
    let ctx = ctx(&c);

    let s1 = stream(&c, ctx).unwrap();
    stream(&c, ctx).unwrap();
    assert_eq!(stream(&c, ctx), Err(OUT_OF_MEMORY), "a third stream");
    assert_eq!(c.rm_stream_destroy(&s1).unwrap(), 0);
    stream(&c, ctx).expect("room again after a destroy");

    // --limit wins over the file's 3.
    let e1 = event(&c, ctx).unwrap();
    event(&c, ctx).unwrap();
    assert_eq!(event(&c, ctx), Err(OUT_OF_MEMORY));
    assert_eq!(c.rm_event_destroy(&e1).unwrap(), 0);
    event(&c, ctx).unwrap();
    // A batch that does not fit is refused whole.
    let batch = c
        .rm_event_create_many(&RmEventBatchArgs {
            ctx,
            flags: 0,
            count: 2,
        })
        .unwrap();
    assert!(
        matches!(
            batch,
            RmHandlesReply::Default {
                discriminant: OUT_OF_MEMORY
            }
        ),
        "{batch:?}"
    );

    assert!(matches!(load(&c, ctx, 0), RmLoadReply::RmLoaded(_)));
    assert_eq!(load(&c, ctx, 1), RmLoadReply::RmLoadFailed(OUT_OF_MEMORY));

    let a = alloc(&c, ctx, 700 << 10).unwrap();
    assert_eq!(alloc(&c, ctx, 400 << 10), Err(OUT_OF_MEMORY));
    let b = alloc(&c, ctx, 300 << 10).unwrap();
    assert_eq!(c.rm_mem_free(&RmPtrArgs { ctx, ptr: a }).unwrap(), 0);
    alloc(&c, ctx, 700 << 10).expect("the freed bytes are free again");
    assert_eq!(c.rm_mem_free(&RmPtrArgs { ctx, ptr: b }).unwrap(), 0);
    // A pitched allocation counts its padding.
    let pitched = c
        .rm_mem_alloc_pitch(&RmAllocPitchArgs {
            ctx,
            width_bytes: 100,
            height: 4000,
            element_size: 4,
        })
        .unwrap();
    assert!(
        matches!(
            pitched,
            RmPitchedReply::Default {
                discriminant: OUT_OF_MEMORY
            }
        ),
        "100 x 4000 rows pitched to 512 bytes is 2 MB: {pitched:?}"
    );
    drop(c);
    running.shutdown();
}

#[test]
fn a_tenant_is_limited_over_all_its_sessions_and_other_tenants_are_not() {
    let dir = tempfile::tempdir().unwrap();
    let uid = rustix::process::getuid().as_raw();
    let (running, endpoint) = serve(
        &dir,
        Some(&format!(
            "[tenant]\ndevice-memory = \"1MiB\"\nsessions = 2\n[tenants.\"uid:{uid}\"]\nstreams = 3\n"
        )),
        &[],
    );
    let tcp = running
        .endpoints()
        .into_iter()
        .find(|e| matches!(e, Endpoint::Tcp(..)))
        .unwrap();
    // Two sessions of this user (Unix socket: tenant uid:N).
    let a = client(&endpoint);
    let b = client(&endpoint);
    let (ca, cb) = (ctx(&a), ctx(&b));
    let pa = alloc(&a, ca, 600 << 10).unwrap();
    assert_eq!(
        alloc(&b, cb, 600 << 10),
        Err(OUT_OF_MEMORY),
        "past the tenant's 1 MiB"
    );
    // Another tenant (anonymous TCP) has its own MiB.
    let t = client(&tcp);
    let ct = ctx(&t);
    alloc(&t, ct, 900 << 10).expect("another tenant is not charged for this one");
    // The tenant table's `streams` is the tenant's, over its sessions.
    stream(&a, ca).unwrap();
    stream(&b, cb).unwrap();
    stream(&a, ca).unwrap();
    assert_eq!(stream(&b, cb), Err(OUT_OF_MEMORY));
    stream(&t, ct).expect("the anonymous tenant has no stream limit of 3");

    // A third session of the tenant is refused at HELLO, with the reason.
    let third = client(&endpoint);
    match hello(&third) {
        HelloReply::False(r) => assert!(
            r.reason.contains("sessions") && r.reason.contains(&format!("uid:{uid}")),
            "{}",
            r.reason
        ),
        other => panic!("a third session was let in: {other:?}"),
    }
    // Whatever it asks for after that is refused too.
    let ctx3 = handle(third.rm_primary_ctx_retain(&0).unwrap()).unwrap();
    assert_eq!(alloc(&third, ctx3, 1), Err(OUT_OF_MEMORY));
    drop(third);

    // A session's end gives back everything it held, and its place.
    assert_eq!(a.rm_mem_free(&RmPtrArgs { ctx: ca, ptr: pa }).unwrap(), 0);
    alloc(&b, cb, 600 << 10).expect("freed by the other session");
    drop(a);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let d = loop {
        let d = client(&endpoint);
        if matches!(hello(&d), HelloReply::True(_)) {
            break d;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the closed sessions' places never came back"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let cd = handle(d.rm_primary_ctx_retain(&0).unwrap()).unwrap();
    alloc(&d, cd, 300 << 10).expect("room for the new session");
    drop((b, d, t));
    running.shutdown();
}

#[test]
fn a_bad_limits_file_or_limit_stops_the_server_with_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    let backend = Arc::new(EmulatedBackend::new(EmulatedConfig::default()));
    let start = |tenants: Option<std::path::PathBuf>, limits: Vec<String>| {
        start_with_backend(
            ServeConfig {
                listen: vec![Endpoint::Unix(dir.path().join("x.sock"))],
                tenants_file: tenants,
                limits,
                ..ServeConfig::default()
            },
            Arc::clone(&backend) as Arc<dyn Backend>,
            inventory_of(&*backend),
        )
        .map(|r| r.shutdown())
        .unwrap_err()
        .to_string()
    };
    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, "[session]\nstreamz = 1\n").unwrap();
    let e = start(Some(bad.clone()), vec![]);
    assert!(
        e.contains("bad.toml") && e.contains("unknown key `streamz`"),
        "{e}"
    );
    let e = start(Some(dir.path().join("missing.toml")), vec![]);
    assert!(e.contains("cannot read the tenants file"), "{e}");
    let e = start(None, vec!["session.sessions=1".into()]);
    assert!(e.contains("tenant limit"), "{e}");
}

/// Issues `n` one-way 4 KiB device-to-host copies of `src` without synchronizing.
fn copies(c: &RemoraV1Client, ctx: u64, src: u64, n: u64) {
    for copy_id in 1..=n {
        c.rm_memcpy_dtoh_async(&RmDtohArgs {
            ctx,
            stream: 0,
            src,
            size: 4096,
            copy_id,
        })
        .unwrap();
    }
}

#[test]
fn a_tenants_bytes_in_flight_are_bounded_over_its_sessions() {
    let dir = tempfile::tempdir().unwrap();
    // Room for about 8 copies of 4 KiB (each counts 256 bytes more) for the whole tenant.
    let (running, endpoint) = serve(&dir, None, &["tenant.in-flight=36KiB"]);
    let a = client(&endpoint);
    let b = client(&endpoint);
    let (ca, cb) = (ctx(&a), ctx(&b));
    let (sa, sb) = (alloc(&a, ca, 4096).unwrap(), alloc(&b, cb, 4096).unwrap());
    copies(&a, ca, sa, 5);
    // A synchronous call on a's connection: its one-way copies have all been admitted
    // before b issues any.
    a.rm_device_get_count().unwrap();
    copies(&b, cb, sb, 5);
    let rb = b.rm_ctx_synchronize(&cb).unwrap();
    assert_eq!(
        rb.status, OUT_OF_MEMORY,
        "b's copies past the tenant's bytes in flight"
    );
    let full = rb.copies.iter().filter(|c| c.data.len() == 4096).count();
    assert_eq!(
        (rb.copies.len(), full),
        (5, 3),
        "three of b's copies fit beside a's five"
    );
    let ra = a.rm_ctx_synchronize(&ca).unwrap();
    assert_eq!(ra.status, 0);
    assert!(ra.copies.iter().all(|c| c.data.len() == 4096));
    // Delivered copies are out of flight: room again, for both.
    copies(&b, cb, sb, 8);
    let rb = b.rm_ctx_synchronize(&cb).unwrap();
    assert_eq!(rb.status, 0, "room again once delivered");
    assert_eq!(rb.copies.len(), 8);
    drop((a, b));
    running.shutdown();
}

/// `GET path` on `addr`: (status line, body).
fn http_get(addr: std::net::SocketAddr, path: &str) -> (String, String) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    write!(s, "GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    let (head, body) = text.split_once("\r\n\r\n").unwrap();
    (head.lines().next().unwrap().to_owned(), body.to_owned())
}

#[test]
fn metrics_show_each_tenants_use_and_refusals() {
    let dir = tempfile::tempdir().unwrap();
    let backend = Arc::new(EmulatedBackend::new(EmulatedConfig::default()));
    let endpoint = Endpoint::Unix(dir.path().join("remora.sock"));
    let running = start_with_backend(
        ServeConfig {
            listen: vec![endpoint.clone()],
            limits: vec!["session.streams=1".into()],
            metrics: Some("tcp://127.0.0.1:0".parse().unwrap()),
            ..ServeConfig::default()
        },
        Arc::clone(&backend) as Arc<dyn Backend>,
        inventory_of(&*backend),
    )
    .unwrap();
    let addr = running.metrics_addr().expect("metrics asked for");
    let uid = rustix::process::getuid().as_raw();
    let c = client(&endpoint);
    let ctx = ctx(&c);
    alloc(&c, ctx, 12345).unwrap();
    stream(&c, ctx).unwrap();
    assert_eq!(stream(&c, ctx), Err(OUT_OF_MEMORY));

    let (status, body) = http_get(addr, "/metrics");
    assert!(status.contains("200"), "{status}");
    let tenant = format!("tenant=\"uid:{uid}\"");
    assert!(
        body.lines()
            .any(|l| l.starts_with("remora_tenant_sessions{")
                && l.contains(&tenant)
                && l.ends_with(" 1")),
        "{body}"
    );
    assert!(
        body.lines().any(|l| l.starts_with("remora_tenant_usage{")
            && l.contains(&tenant)
            && l.contains("kind=\"device_memory\"")
            && l.ends_with(" 12345")),
        "{body}"
    );
    assert!(
        body.lines()
            .any(|l| l.starts_with("remora_tenant_limit_refusals_total{")
                && l.contains(&tenant)
                && l.contains("kind=\"streams\"")
                && l.ends_with(" 1")),
        "{body}"
    );
    assert!(body.contains("remora_sessions 1"), "{body}");
    assert!(http_get(addr, "/other").0.contains("404"));

    // The session ends: its use goes, its refusals stay.
    drop(c);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let body = http_get(addr, "/metrics").1;
        // The session leaves the table just before its last reference (holding its slot in
        // the ledger) goes: its use may outlive it by a moment.
        let used = body.lines().any(|l| {
            l.starts_with("remora_tenant_usage{")
                && l.contains("device_memory")
                && !l.ends_with(" 0")
        });
        if body.contains("remora_sessions 0") && !used {
            assert!(
                body.lines()
                    .any(|l| l.starts_with("remora_tenant_limit_refusals_total{")
                        && l.ends_with(" 1")),
                "{body}"
            );
            break;
        }
        assert!(std::time::Instant::now() < deadline, "{body}");
        std::thread::sleep(Duration::from_millis(50));
    }
    running.shutdown();
}

#[test]
fn metrics_on_an_address_other_hosts_reach_need_insecure() {
    let dir = tempfile::tempdir().unwrap();
    let backend = Arc::new(EmulatedBackend::new(EmulatedConfig::default()));
    let e = start_with_backend(
        ServeConfig {
            listen: vec![Endpoint::Unix(dir.path().join("x.sock"))],
            metrics: Some("tcp://0.0.0.0:0".parse().unwrap()),
            ..ServeConfig::default()
        },
        Arc::clone(&backend) as Arc<dyn Backend>,
        inventory_of(&*backend),
    )
    .map(|r| r.shutdown())
    .unwrap_err()
    .to_string();
    assert!(e.contains("--insecure") && e.contains("tenant"), "{e}");
}

#[test]
fn the_tenant_map_makes_a_local_user_a_named_tenant() {
    let dir = tempfile::tempdir().unwrap();
    let uid = rustix::process::getuid().as_raw();
    let map = dir.path().join("uids");
    std::fs::write(&map, format!("# local users\n{uid} team\n")).unwrap();
    let tenants = dir.path().join("tenants.toml");
    std::fs::write(&tenants, "[tenants.team.session]\nstreams = 1\n").unwrap();
    let backend = Arc::new(EmulatedBackend::new(EmulatedConfig::default()));
    let endpoint = Endpoint::Unix(dir.path().join("remora.sock"));
    let running = start_with_backend(
        ServeConfig {
            listen: vec![endpoint.clone()],
            tenants_file: Some(tenants),
            tenant_map: Some(map),
            ..ServeConfig::default()
        },
        Arc::clone(&backend) as Arc<dyn Backend>,
        inventory_of(&*backend),
    )
    .unwrap();
    let c = client(&endpoint);
    let ctx = ctx(&c);
    stream(&c, ctx).unwrap();
    assert_eq!(
        stream(&c, ctx),
        Err(OUT_OF_MEMORY),
        "team's own session limit"
    );
    let status = c.remora_status().unwrap();
    assert!(
        status.all_tenants,
        "no authentication: every tenant is listed"
    );
    let names: Vec<&str> = status.tenants.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["team"]);
    assert_eq!(
        (status.tenants[0].streams, status.tenants[0].refusals),
        (1, 1)
    );
    drop(c);
    running.shutdown();
}

#[test]
fn a_large_image_that_fails_its_hash_is_refused_and_leaves_no_module() {
    // Images from 1 MiB on are checked against their SHA-256 beside the driver's load: a
    // mismatch must still refuse the load, unload what the driver loaded (with `modules = 1`
    // a module left behind would refuse the next load) and cache nothing.
    let dir = tempfile::tempdir().unwrap();
    let (running, endpoint) = serve(&dir, Some("[session]\nmodules = 1\n"), &[]);
    let c = client(&endpoint);
    let ctx = ctx(&c);
    // Blank lines pad the emulated module past the threshold.
    let text = format!(
        "REMORA-EMU-MODULE\nfunc big 8,4\nfunc other\n{}",
        "\n".repeat(3 << 20)
    );
    let image = Bytes::from(text.into_bytes());
    let hash: [u8; 32] = Sha256::digest(&image).into();
    let mut bad = hash;
    bad[31] ^= 0x80;
    let cache = || running.executor().unwrap().cached_modules();
    assert_eq!(
        c.rm_module_load(&RmModuleLoadArgs {
            ctx,
            hash: bad,
            image: image.clone()
        })
        .unwrap(),
        RmLoadReply::RmLoadFailed(1), // CUDA_ERROR_INVALID_VALUE
    );
    assert_eq!(cache(), 0);
    let RmLoadReply::RmLoaded(m) = c
        .rm_module_load(&RmModuleLoadArgs {
            ctx,
            hash,
            image: image.clone(),
        })
        .unwrap()
    else {
        panic!("the refused load left its module behind (modules = 1)")
    };
    let names: Vec<_> = m.functions.iter().map(|f| f.name.as_str()).collect();
    assert_eq!(names.len(), 2, "{names:?}");
    assert!(
        names.contains(&"big") && names.contains(&"other"),
        "{names:?}"
    );
    let big = m.functions.iter().find(|f| f.name == "big").unwrap();
    assert_eq!(
        big.params
            .iter()
            .map(|p| (p.offset, p.size))
            .collect::<Vec<_>>(),
        [(0, 8), (8, 4)]
    );
    assert_eq!(cache(), 1);
    // The cached copy serves a load by hash alone, once the first module is unloaded.
    assert_eq!(c.rm_module_unload(&m.module).unwrap(), 0);
    let RmLoadReply::RmLoaded(again) = c
        .rm_module_load(&RmModuleLoadArgs {
            ctx,
            hash,
            image: Bytes::new(),
        })
        .unwrap()
    else {
        panic!("the image was not cached")
    };
    assert_eq!(again.functions.len(), 2);
}
