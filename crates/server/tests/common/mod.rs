//! Helpers of the data-area tests (`area_copies.rs`, `pinned_area.rs`): an emulated
//! `remora serve` with a shared data area of a given size, sessions over a chosen transport,
//! test patterns.
#![allow(dead_code, unreachable_pub)]

use std::sync::{Arc, Mutex};

use remora_client::proto::*;
use remora_client::{Session, SessionConfig};
use remora_oncrpc::{Endpoint, TransportChoice};
use remora_server::{
    Backend, EmulatedBackend, EmulatedConfig, Running, ServeConfig, ShmConfig, inventory_of,
    start_with_backend,
};

pub const LEGACY: u64 = RM_STREAM_LEGACY as u64;
/// The data area of these tests: small, so that copies larger than it are cheap.
pub const AREA: u64 = 256 << 10;

pub static SERIAL: Mutex<()> = Mutex::new(());

pub struct Server {
    _dir: tempfile::TempDir,
    running: Option<Running>,
    pub endpoint: Endpoint,
    /// The emulated GPU behind it.
    pub backend: Arc<EmulatedBackend>,
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(r) = self.running.take() {
            r.shutdown();
        }
    }
}

/// An emulated server on a private Unix socket whose shared-memory sessions get a data area
/// of `data_bytes`.
pub fn serve(data_bytes: u64) -> Server {
    serve_with(ShmConfig {
        enabled: true,
        data_bytes,
        ..ShmConfig::default()
    })
}

/// An emulated server on a private Unix socket with shared memory as `shm` says.
pub fn serve_with(shm: ShmConfig) -> Server {
    serve_emulated(shm, EmulatedConfig::default())
}

/// An emulated server (`config`) on a private Unix socket and on loopback TCP (see
/// [`Server::tcp`]), with shared memory as `shm` says.
pub fn serve_emulated(shm: ShmConfig, config: EmulatedConfig) -> Server {
    let dir = tempfile::tempdir().unwrap();
    let backend = Arc::new(EmulatedBackend::new(config));
    let endpoint = Endpoint::Unix(dir.path().join("remora.sock"));
    let running = start_with_backend(
        ServeConfig {
            listen: vec![endpoint.clone(), "tcp://127.0.0.1:0".parse().unwrap()],
            shm,
            ..ServeConfig::default()
        },
        Arc::clone(&backend) as Arc<dyn Backend>,
        inventory_of(&*backend),
    )
    .unwrap();
    Server {
        _dir: dir,
        running: Some(running),
        endpoint,
        backend,
    }
}

impl Server {
    /// The server's loopback TCP endpoint.
    pub fn tcp(&self) -> Endpoint {
        self.running
            .as_ref()
            .unwrap()
            .endpoints()
            .into_iter()
            .find(|e| matches!(e, Endpoint::Tcp(..)))
            .expect("the server listens on TCP")
    }

    /// The server's executor (thread isolation: one for all sessions).
    pub fn executor(&self) -> &remora_server::Executor {
        self.running
            .as_ref()
            .and_then(Running::executor)
            .expect("a thread-isolated server has an executor")
    }
}

pub fn session(endpoint: &Endpoint, transport: TransportChoice) -> Session {
    Session::connect_with(
        endpoint,
        SessionConfig {
            transport,
            ..SessionConfig::default()
        },
    )
    .unwrap()
}

/// A test's emulated server (no data area) and one Unix-socket session on it, holding
/// [`SERIAL`]. Fields drop in order: the session, then the server, then the lock.
pub struct UnixSession {
    pub s: Session,
    pub server: Server,
    _serial: std::sync::MutexGuard<'static, ()>,
}

/// [`UnixSession`]: takes [`SERIAL`], starts `serve(0)` and connects over the Unix socket.
pub fn unix_session() -> UnixSession {
    let serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let server = serve(0);
    UnixSession {
        s: session(&server.endpoint, TransportChoice::Unix),
        server,
        _serial: serial,
    }
}

pub fn pattern(n: usize, seed: u32) -> Vec<u8> {
    (0..n as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) ^ seed.wrapping_mul(97)) as u8 ^ (i >> 9) as u8)
        .collect()
}

/// Launches emulated kernel `f` on `stream`, one block of 64 threads, with one `u64` per
/// parameter (a parameter narrower than 8 bytes is read from its low, little-endian bytes).
pub fn launch_u64s(
    s: &Session,
    ctx: u64,
    f: &remora_client::FunctionInfo,
    stream: u64,
    args: &[u64],
) {
    let config = remora_client::LaunchConfig {
        grid: [1, 1, 1],
        block: [64, 1, 1],
        shared_mem_bytes: 0,
        stream: remora_client::StreamRef::Handle(stream),
        attrs: Vec::new(),
    };
    let ptrs: Vec<*const std::ffi::c_void> =
        args.iter().map(|a| (a as *const u64).cast()).collect();
    // SAFETY: one valid pointer per parameter; each points at 8 readable bytes, at least the
    // parameter's size.
    unsafe {
        s.launch_kernel(
            ctx,
            f,
            &config,
            remora_client::KernelArgs::Params(ptrs.as_ptr()),
        )
    }
    .unwrap();
}

/// What the `fill_i32` tests work on: the primary context of device 0, a stream, the
/// emulated module with `fill_i32` and `missing` (a kernel whose launch fails), and 256
/// bytes of device memory.
pub struct FillKit {
    pub ctx: u64,
    pub stream: u64,
    pub module: Arc<remora_client::ModuleInfo>,
    pub p: u64,
}

impl FillKit {
    /// Sets it up in `s`, the stream made with `stream_flags`.
    pub fn new(s: &Session, stream_flags: u32) -> Self {
        let ctx = s.primary_ctx_retain(0).unwrap();
        let stream = s.stream_create(ctx, stream_flags, 0).unwrap();
        let module = s
            .module_load(
                ctx,
                b"REMORA-EMU-MODULE\nfunc fill_i32 8,4,4\nfunc missing 8\n",
            )
            .unwrap();
        let p = s.mem_alloc(ctx, 256).unwrap();
        Self {
            ctx,
            stream,
            module,
            p,
        }
    }

    /// The module's function `name`.
    pub fn function(&self, name: &str) -> &remora_client::FunctionInfo {
        &self.module.functions[name]
    }
}

/// `fill_i32(int *p, int v, int n)` over 64 ints on `stream`: `p[i] = v + i`.
pub fn fill_i32(
    s: &Session,
    ctx: u64,
    f: &remora_client::FunctionInfo,
    p: u64,
    v: i32,
    stream: u64,
) {
    launch_u64s(s, ctx, f, stream, &[p, v as u32 as u64, 64]);
}

/// `rounds` launch + stream synchronize round trips of `fill_i32` in a fresh [`FillKit`]
/// (stream flags 1), each result read back and checked: `p[i] = v + i` for round `v`.
pub fn fill_sync_rounds(s: &Session, rounds: i32) {
    let kit = FillKit::new(s, 1);
    let (ctx, stream, p) = (kit.ctx, kit.stream, kit.p);
    let f = kit.function("fill_i32");
    for v in 0..rounds {
        fill_i32(s, ctx, f, p, v, stream);
        s.stream_synchronize(ctx, stream).unwrap();
        assert_eq!(ints(s, ctx, p), (v..v + 64).collect::<Vec<_>>());
    }
}

/// The 64 ints at `p`, read with a synchronous copy on the legacy stream.
pub fn ints(s: &Session, ctx: u64, p: u64) -> Vec<i32> {
    let mut back = vec![0u8; 256];
    s.memcpy_dtoh(ctx, LEGACY, p, &mut back).unwrap();
    back.chunks(4)
        .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// An asynchronous device-to-host copy of `len` bytes at `src` on `stream`: the returned
/// buffer holds them once delivered (at the synchronizing call that carries them).
pub fn dtoh_async(s: &Session, ctx: u64, stream: u64, src: u64, len: u64) -> Arc<Mutex<Vec<u8>>> {
    let got = Arc::new(Mutex::new(Vec::new()));
    let sink = Arc::clone(&got);
    s.memcpy_dtoh_async(
        ctx,
        stream,
        src,
        len,
        Box::new(move |b: &[u8]| sink.lock().unwrap().extend_from_slice(b)),
    )
    .unwrap();
    got
}
