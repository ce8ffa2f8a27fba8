//! The built libcuda.so.1, loaded with libloading, against a real `remora serve` process.
//!
//! The `remora` binary is found next to this test's target directory (build it with
//! `cargo build -p remora-cli`) or through `REMORA_BIN`; without it the tests print SKIPPED.

use std::ffi::{c_int, c_uint, c_void};
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent().unwrap().parent().unwrap().to_path_buf()
}

fn remora_bin() -> Option<PathBuf> {
    let p = std::env::var_os("REMORA_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| target_dir().join("remora"));
    p.exists().then_some(p)
}

/// The shim cdylib. `cargo test` refreshes the copy under deps/ but may leave an older one
/// beside the binaries: use the newest.
fn shim_path() -> PathBuf {
    [
        target_dir().join("libcuda.so"),
        target_dir().join("deps/libcuda.so"),
    ]
    .into_iter()
    .filter_map(|p| Some((std::fs::metadata(&p).ok()?.modified().ok()?, p)))
    .max()
    .map(|(_, p)| p)
    .unwrap_or_else(|| target_dir().join("libcuda.so"))
}

struct Serve(Child, String);

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[allow(clippy::zombie_processes)] // the child is waited for on exit and by Serve's drop
/// Starts `remora serve` with `args`; `None` if it exits at once (e.g. clap's exit code 2).
fn serve(bin: &PathBuf, args: &[&str], env: &[(&str, &str)]) -> Result<Serve, i32> {
    let mut cmd = Command::new(bin);
    cmd.arg("serve")
        .args(["--listen", "tcp://127.0.0.1:0"])
        .args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut reader = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    loop {
        line.clear();
        if reader.read_line(&mut line).unwrap() == 0 {
            let status = child.wait().unwrap();
            return Err(status.code().unwrap_or(-1));
        }
        if let Some(url) = line.trim().strip_prefix("remora serve: listening on ") {
            return Ok(Serve(child, url.to_owned()));
        }
    }
}

/// Runs `body` in a child process of this test binary (the shim's state is per process).
fn in_child(test: &str, url: &str) -> std::process::Output {
    in_child_with(test, url, &[])
}

/// [`in_child`] with extra environment variables.
fn in_child_with(test: &str, url: &str, env: &[(&str, &str)]) -> std::process::Output {
    Command::new(std::env::current_exe().unwrap())
        .args(["--exact", test, "--nocapture", "--include-ignored"])
        .env("REMORA_SERVER", url)
        .env("REMORA_SHIM_CHILD", "1")
        .envs(env.iter().copied())
        .output()
        .unwrap()
}

type Init = unsafe extern "C" fn(c_uint) -> c_int;
type GetCount = unsafe extern "C" fn(*mut c_int) -> c_int;
type GetProc = unsafe extern "C" fn(*const i8, *mut *mut c_void, c_int, u64, *mut c_int) -> c_int;

#[test]
#[ignore = "run in a child process by no_driver_server_means_no_device"]
fn child_no_device() {
    if std::env::var_os("REMORA_SHIM_CHILD").is_none() {
        return;
    }
    // SAFETY: loading our own shim, which runs no initialization code with side effects.
    let lib = unsafe { libloading::Library::new(shim_path()) }.unwrap();
    // SAFETY: the symbols have these signatures (cuda.h).
    unsafe {
        let init: libloading::Symbol<Init> = lib.get(b"cuInit").unwrap();
        let count: libloading::Symbol<GetCount> = lib.get(b"cuDeviceGetCount").unwrap();
        let start = Instant::now();
        assert_eq!(init(0), 100, "cuInit must report CUDA_ERROR_NO_DEVICE");
        assert!(start.elapsed() < Duration::from_secs(10));
        // As with NVIDIA's driver: nothing but cuInit works until a cuInit succeeds.
        let mut n: c_int = -1;
        assert_eq!(
            count(&mut n),
            3,
            "CUDA_ERROR_NOT_INITIALIZED after a failed cuInit"
        );
        let gpa: libloading::Symbol<GetProc> = lib.get(b"cuGetProcAddress_v2").unwrap();
        let mut f: *mut c_void = std::ptr::null_mut();
        let mut st: c_int = -1;
        assert_eq!(
            gpa(
                c"cuGraphAddBatchMemOpNode".as_ptr(),
                &mut f,
                13000,
                0,
                &mut st
            ),
            0
        );
        assert!(!f.is_null());
        let stub: extern "C" fn() -> c_int = std::mem::transmute(f);
        assert_eq!(stub(), 801);
    }
    println!("CHILD-OK");
}

#[test]
fn no_driver_server_means_no_device() {
    let Some(bin) = remora_bin() else {
        println!("SKIPPED: remora binary not built (cargo build -p remora-cli)");
        return;
    };
    let s = serve(
        &bin,
        &[],
        &[("REMORA_REAL_LIBCUDA", "/nonexistent/libcuda.so.1")],
    )
    .unwrap();
    let out = in_child("child_no_device", &s.1);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("CHILD-OK"),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn unreachable_server_means_no_device() {
    let out = in_child("child_no_device", "tcp://127.0.0.1:1");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("CHILD-OK"),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn emulated_backend() {
    let Some(bin) = remora_bin() else {
        println!("SKIPPED: remora binary not built (cargo build -p remora-cli)");
        return;
    };
    match serve(&bin, &["--backend", "emulated"], &[]) {
        Err(2) => println!("SKIPPED: emulated backend not available"),
        Err(code) => panic!("remora serve --backend emulated exited with {code}"),
        Ok(s) => {
            // The lead wires the end-to-end checks once the emulated backend is merged:
            // at least cuInit must succeed against it.
            let out = Command::new(std::env::current_exe().unwrap())
                .args([
                    "--exact",
                    "child_init_ok",
                    "--nocapture",
                    "--include-ignored",
                ])
                .env("REMORA_SERVER", &s.1)
                .env("REMORA_SHIM_CHILD", "1")
                .output()
                .unwrap();
            assert!(String::from_utf8_lossy(&out.stdout).contains("CHILD-OK"));
        }
    }
}

#[test]
#[ignore = "run in a child process by emulated_backend"]
fn child_init_ok() {
    if std::env::var_os("REMORA_SHIM_CHILD").is_none() {
        return;
    }
    // SAFETY: loading our own shim.
    let lib = unsafe { libloading::Library::new(shim_path()) }.unwrap();
    // SAFETY: the symbol has this signature (cuda.h).
    unsafe {
        let init: libloading::Symbol<Init> = lib.get(b"cuInit").unwrap();
        assert_eq!(init(0), 0);
    }
    println!("CHILD-OK");
}

/// `CUDA_MEMCPY2D` as cuda.h 13.0 lays it out.
#[repr(C)]
#[derive(Clone, Copy)]
struct Memcpy2D {
    src_x: usize,
    src_y: usize,
    src_type: c_uint,
    src_host: *const c_void,
    src_device: u64,
    src_array: *mut c_void,
    src_pitch: usize,
    dst_x: usize,
    dst_y: usize,
    dst_type: c_uint,
    dst_host: *mut c_void,
    dst_device: u64,
    dst_array: *mut c_void,
    dst_pitch: usize,
    width: usize,
    height: usize,
}

/// `CUDA_MEMCPY2D_v1` (the ABI of plain `cuMemcpy2D`).
#[repr(C)]
#[derive(Clone, Copy)]
struct Memcpy2DV1 {
    src_x: c_uint,
    src_y: c_uint,
    src_type: c_uint,
    src_host: *const c_void,
    src_device: c_uint,
    src_array: *mut c_void,
    src_pitch: c_uint,
    dst_x: c_uint,
    dst_y: c_uint,
    dst_type: c_uint,
    dst_host: *mut c_void,
    dst_device: c_uint,
    dst_array: *mut c_void,
    dst_pitch: c_uint,
    width: c_uint,
    height: c_uint,
}

/// `CUDA_MEMCPY3D` / `CUDA_MEMCPY3D_PEER` as cuda.h 13.0 lays them out (`ctx` fields are
/// `reserved0/1` in the non-peer form).
#[repr(C)]
#[derive(Clone, Copy)]
struct Memcpy3D {
    src_x: usize,
    src_y: usize,
    src_z: usize,
    src_lod: usize,
    src_type: c_uint,
    src_host: *const c_void,
    src_device: u64,
    src_array: *mut c_void,
    src_ctx: *mut c_void,
    src_pitch: usize,
    src_height: usize,
    dst_x: usize,
    dst_y: usize,
    dst_z: usize,
    dst_lod: usize,
    dst_type: c_uint,
    dst_host: *mut c_void,
    dst_device: u64,
    dst_array: *mut c_void,
    dst_ctx: *mut c_void,
    dst_pitch: usize,
    dst_height: usize,
    width: usize,
    height: usize,
    depth: usize,
}

#[test]
fn emulated_2d_3d_and_peer_copies() {
    let Some(bin) = remora_bin() else {
        println!("SKIPPED: remora binary not built (cargo build -p remora-cli)");
        return;
    };
    match serve(&bin, &["--backend", "emulated"], &[]) {
        Err(2) => println!("SKIPPED: emulated backend not available"),
        Err(code) => panic!("remora serve --backend emulated exited with {code}"),
        Ok(s) => {
            let out = in_child("child_memcpy_2d_3d_peer", &s.1);
            let text = String::from_utf8_lossy(&out.stdout);
            assert!(
                text.contains("CHILD-OK"),
                "{text}\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
}

#[test]
#[ignore = "run in a child process by emulated_2d_3d_and_peer_copies"]
fn child_memcpy_2d_3d_peer() {
    if std::env::var_os("REMORA_SHIM_CHILD").is_none() {
        return;
    }
    type CtxCreate = unsafe extern "C" fn(*mut *mut c_void, c_uint, c_int) -> c_int;
    type Alloc = unsafe extern "C" fn(*mut u64, usize) -> c_int;
    type Htod = unsafe extern "C" fn(u64, *const c_void, usize) -> c_int;
    type Dtoh = unsafe extern "C" fn(*mut c_void, u64, usize) -> c_int;
    type Copy2D = unsafe extern "C" fn(*const Memcpy2D) -> c_int;
    type Copy2DV1 = unsafe extern "C" fn(*const Memcpy2DV1) -> c_int;
    type Copy3D = unsafe extern "C" fn(*const Memcpy3D) -> c_int;
    type Copy3DAsync = unsafe extern "C" fn(*const Memcpy3D, *mut c_void) -> c_int;
    type StreamCreate = unsafe extern "C" fn(*mut *mut c_void, c_uint) -> c_int;
    type StreamSync = unsafe extern "C" fn(*mut c_void) -> c_int;
    type SetCurrent = unsafe extern "C" fn(*mut c_void) -> c_int;
    type Peer = unsafe extern "C" fn(u64, *mut c_void, u64, *mut c_void, usize) -> c_int;

    let pattern = |n: usize, seed: u8| -> Vec<u8> {
        (0..n)
            .map(|i| (i as u8).wrapping_mul(31) ^ seed ^ (i >> 8) as u8)
            .collect()
    };
    // SAFETY: loading our own shim.
    let lib = unsafe { libloading::Library::new(shim_path()) }.unwrap();
    // SAFETY: every symbol has the signature cuda.h gives it; the descriptors are laid out as
    // cuda.h lays them out and point to buffers that outlive each call.
    unsafe {
        let init: libloading::Symbol<Init> = lib.get(b"cuInit").unwrap();
        let ctx_create: libloading::Symbol<CtxCreate> = lib.get(b"cuCtxCreate_v2").unwrap();
        let set_current: libloading::Symbol<SetCurrent> = lib.get(b"cuCtxSetCurrent").unwrap();
        let alloc: libloading::Symbol<Alloc> = lib.get(b"cuMemAlloc_v2").unwrap();
        let htod: libloading::Symbol<Htod> = lib.get(b"cuMemcpyHtoD_v2").unwrap();
        let dtoh: libloading::Symbol<Dtoh> = lib.get(b"cuMemcpyDtoH_v2").unwrap();
        let copy2d: libloading::Symbol<Copy2D> = lib.get(b"cuMemcpy2D_v2").unwrap();
        let copy2d_v1: libloading::Symbol<Copy2DV1> = lib.get(b"cuMemcpy2D").unwrap();
        let copy3d: libloading::Symbol<Copy3D> = lib.get(b"cuMemcpy3D_v2").unwrap();
        let copy3d_async: libloading::Symbol<Copy3DAsync> = lib.get(b"cuMemcpy3DAsync_v2").unwrap();
        let copy3d_peer: libloading::Symbol<Copy3D> = lib.get(b"cuMemcpy3DPeer").unwrap();
        let stream_create: libloading::Symbol<StreamCreate> = lib.get(b"cuStreamCreate").unwrap();
        let stream_sync: libloading::Symbol<StreamSync> = lib.get(b"cuStreamSynchronize").unwrap();
        let peer: libloading::Symbol<Peer> = lib.get(b"cuMemcpyPeer").unwrap();
        assert_eq!(init(0), 0);
        let (mut a, mut b) = (std::ptr::null_mut(), std::ptr::null_mut());
        assert_eq!(ctx_create(&mut a, 0, 0), 0);
        assert_eq!(ctx_create(&mut b, 0, 0), 0);
        assert_eq!(set_current(a), 0);
        // Context ids: distinct per context, the current one for NULL, stable.
        type CtxGetId = unsafe extern "C" fn(*mut c_void, *mut u64) -> c_int;
        let get_id: libloading::Symbol<CtxGetId> = lib.get(b"cuCtxGetId").unwrap();
        let (mut ia, mut ib, mut icur) = (0u64, 0u64, 0u64);
        assert_eq!(get_id(a, &mut ia), 0);
        assert_eq!(get_id(b, &mut ib), 0);
        assert_eq!(get_id(std::ptr::null_mut(), &mut icur), 0);
        assert!(ia != ib && ia == icur, "{ia} {ib} {icur}");
        assert_eq!(get_id(a, std::ptr::null_mut()), 1);

        // 2-D host → device with offsets and odd pitches, then device → host.
        let src = pattern(29 * 9, 1);
        let mut dev = 0u64;
        assert_eq!(alloc(&mut dev, 4096), 0);
        assert_eq!(htod(dev, vec![0u8; 4096].as_ptr().cast(), 4096), 0);
        let mut d = Memcpy2D {
            src_x: 3,
            src_y: 2,
            src_type: 1,
            src_host: src.as_ptr().cast(),
            src_device: 0,
            src_array: std::ptr::null_mut(),
            src_pitch: 29,
            dst_x: 5,
            dst_y: 1,
            dst_type: 2,
            dst_host: std::ptr::null_mut(),
            dst_device: dev,
            dst_array: std::ptr::null_mut(),
            dst_pitch: 21,
            width: 13,
            height: 7,
        };
        assert_eq!(copy2d(&d), 0);
        let mut whole = vec![0u8; 4096];
        assert_eq!(dtoh(whole.as_mut_ptr().cast(), dev, 4096), 0);
        for r in 0..7 {
            let got = &whole[(1 + r) * 21 + 5..][..13];
            assert_eq!(got, &src[(2 + r) * 29 + 3..][..13], "row {r}");
        }
        let mut back = vec![0u8; 13 * 7];
        let mut up = d;
        up.src_type = 2;
        up.src_device = dev;
        up.src_host = std::ptr::null();
        up.src_x = 5;
        up.src_y = 1;
        up.src_pitch = 21;
        up.dst_type = 4; // CU_MEMORYTYPE_UNIFIED, a host pointer
        up.dst_device = back.as_mut_ptr() as u64;
        up.dst_x = 0;
        up.dst_y = 0;
        up.dst_pitch = 13;
        assert_eq!(copy2d(&up), 0);
        for r in 0..7 {
            assert_eq!(&back[r * 13..][..13], &src[(2 + r) * 29 + 3..][..13]);
        }

        // Invalid: pitch < width; CUDA arrays are not supported.
        d.src_pitch = 12;
        assert_eq!(copy2d(&d), 1);
        d.src_pitch = 29;
        d.dst_type = 3;
        assert_eq!(copy2d(&d), 801);

        // The version 1 ABI, host to host (32-bit device pointers cannot name our memory).
        let mut out = vec![0u8; 8 * 3];
        let v1 = Memcpy2DV1 {
            src_x: 1,
            src_y: 1,
            src_type: 1,
            src_host: src.as_ptr().cast(),
            src_device: 0,
            src_array: std::ptr::null_mut(),
            src_pitch: 29,
            dst_x: 0,
            dst_y: 0,
            dst_type: 1,
            dst_host: out.as_mut_ptr().cast(),
            dst_device: 0,
            dst_array: std::ptr::null_mut(),
            dst_pitch: 8,
            width: 8,
            height: 3,
        };
        assert_eq!(copy2d_v1(&v1), 0);
        for r in 0..3 {
            assert_eq!(&out[r * 8..][..8], &src[(1 + r) * 29 + 1..][..8]);
        }

        // 3-D device → host, asynchronous, delivered by the stream synchronize.
        let mut stream = std::ptr::null_mut();
        assert_eq!(stream_create(&mut stream, 0), 0);
        // No stream is ever capturing (capture is not supported): the queries say so, after
        // checking the handle.
        type IsCapturing = unsafe extern "C" fn(*mut c_void, *mut c_int) -> c_int;
        type CaptureInfoV3 = unsafe extern "C" fn(
            *mut c_void,
            *mut c_int,
            *mut u64,
            *mut *mut c_void,
            *mut *const c_void,
            *mut *const c_void,
            *mut usize,
        ) -> c_int;
        let is_capturing: libloading::Symbol<IsCapturing> =
            lib.get(b"cuStreamIsCapturing").unwrap();
        let info_v3: libloading::Symbol<CaptureInfoV3> =
            lib.get(b"cuStreamGetCaptureInfo_v3").unwrap();
        let mut status = 7;
        assert_eq!(is_capturing(stream, &mut status), 0);
        assert_eq!(status, 0);
        assert_eq!(is_capturing(std::ptr::null_mut(), &mut status), 0);
        let (mut id, mut count) = (9u64, 9usize);
        let mut graph = std::ptr::dangling_mut::<c_void>();
        status = 7;
        assert_eq!(
            info_v3(
                stream,
                &mut status,
                &mut id,
                &mut graph,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                &mut count
            ),
            0
        );
        assert_eq!((status, id, graph.is_null(), count), (0, 0, true, 0));
        assert_eq!(is_capturing(0x1234_5600 as *mut c_void, &mut status), 400);
        assert_eq!(is_capturing(stream, std::ptr::null_mut()), 1);

        // Stream capture through the C entry points: a memset captured on `stream`, the graph
        // instantiated and launched twice, the capture state seen from the shim.
        type BeginCapture = unsafe extern "C" fn(*mut c_void, c_uint) -> c_int;
        type EndCapture = unsafe extern "C" fn(*mut c_void, *mut *mut c_void) -> c_int;
        type Instantiate = unsafe extern "C" fn(*mut *mut c_void, *mut c_void, u64) -> c_int;
        type GraphLaunch = unsafe extern "C" fn(*mut c_void, *mut c_void) -> c_int;
        type Destroy = unsafe extern "C" fn(*mut c_void) -> c_int;
        type MemsetAsync = unsafe extern "C" fn(u64, u8, usize, *mut c_void) -> c_int;
        let begin: libloading::Symbol<BeginCapture> = lib.get(b"cuStreamBeginCapture_v2").unwrap();
        let end: libloading::Symbol<EndCapture> = lib.get(b"cuStreamEndCapture").unwrap();
        let instantiate: libloading::Symbol<Instantiate> =
            lib.get(b"cuGraphInstantiateWithFlags").unwrap();
        let graph_launch: libloading::Symbol<GraphLaunch> = lib.get(b"cuGraphLaunch").unwrap();
        let exec_destroy: libloading::Symbol<Destroy> = lib.get(b"cuGraphExecDestroy").unwrap();
        let graph_destroy: libloading::Symbol<Destroy> = lib.get(b"cuGraphDestroy").unwrap();
        let memset: libloading::Symbol<MemsetAsync> = lib.get(b"cuMemsetD8Async").unwrap();
        let mut target = 0u64;
        assert_eq!(alloc(&mut target, 256), 0);
        // CU_STREAM_CAPTURE_MODE_RELAXED = 2.
        assert_eq!(begin(stream, 2), 0);
        assert_eq!(is_capturing(stream, &mut status), 0);
        assert_eq!(status, 1, "capturing");
        assert_eq!(memset(target, 0x5A, 256, stream), 0);
        let mut graph = std::ptr::null_mut();
        assert_eq!(end(stream, &mut graph), 0);
        assert!(!graph.is_null());
        assert_eq!(is_capturing(stream, &mut status), 0);
        assert_eq!(status, 0, "capture ended");
        let mut back = [0u8; 256];
        assert_eq!(dtoh(back.as_mut_ptr().cast(), target, 256), 0);
        assert_ne!(
            back, [0x5A; 256],
            "captured work runs only when the graph is launched"
        );
        let mut exec = std::ptr::null_mut();
        assert_eq!(instantiate(&mut exec, graph, 0), 0);
        for _ in 0..2 {
            assert_eq!(graph_launch(exec, stream), 0);
        }
        assert_eq!(stream_sync(stream), 0);
        assert_eq!(dtoh(back.as_mut_ptr().cast(), target, 256), 0);
        assert_eq!(back, [0x5A; 256], "the launched graph ran the memset");
        assert_eq!(exec_destroy(exec), 0);
        assert_eq!(graph_destroy(graph), 0);
        // A captured copy into page-locked memory (in the shared data area over shm): staged
        // around each launch like pageable memory, not refused (it was, with 900).
        type HostAlloc = unsafe extern "C" fn(*mut *mut c_void, usize, c_uint) -> c_int;
        type FreeHost = unsafe extern "C" fn(*mut c_void) -> c_int;
        type DtohAsync = unsafe extern "C" fn(*mut c_void, u64, usize, *mut c_void) -> c_int;
        let host_alloc: libloading::Symbol<HostAlloc> = lib.get(b"cuMemHostAlloc").unwrap();
        let free_host: libloading::Symbol<FreeHost> = lib.get(b"cuMemFreeHost").unwrap();
        let dtoh_async: libloading::Symbol<DtohAsync> = lib.get(b"cuMemcpyDtoHAsync_v2").unwrap();
        let mut pinned = std::ptr::null_mut();
        assert_eq!(host_alloc(&mut pinned, 256, 0), 0);
        assert_eq!(begin(stream, 2), 0);
        assert_eq!(memset(target, 0x33, 256, stream), 0);
        assert_eq!(dtoh_async(pinned, target, 256, stream), 0);
        assert_eq!(end(stream, &mut graph), 0);
        let mut exec = std::ptr::null_mut();
        assert_eq!(instantiate(&mut exec, graph, 0), 0);
        std::ptr::write_bytes(pinned.cast::<u8>(), 0, 256);
        assert_eq!(graph_launch(exec, stream), 0);
        assert_eq!(stream_sync(stream), 0);
        assert_eq!(
            std::slice::from_raw_parts(pinned.cast::<u8>(), 256),
            &[0x33; 256][..],
            "the graph's copy reached page-locked memory"
        );
        assert_eq!(exec_destroy(exec), 0);
        assert_eq!(graph_destroy(graph), 0);
        assert_eq!(free_host(pinned), 0);
        // Ending a capture that never began: CUDA_ERROR_ILLEGAL_STATE.
        assert_eq!(end(stream, &mut graph), 401);
        let slab = pattern(4096, 7);
        assert_eq!(htod(dev, slab.as_ptr().cast(), 4096), 0);
        let mut host = vec![0u8; 10 * 4 * 3];
        let d3 = Memcpy3D {
            src_x: 2,
            src_y: 1,
            src_z: 1,
            src_lod: 0,
            src_type: 2,
            src_host: std::ptr::null(),
            src_device: dev,
            src_array: std::ptr::null_mut(),
            src_ctx: std::ptr::null_mut(),
            src_pitch: 33,
            src_height: 6,
            dst_x: 0,
            dst_y: 0,
            dst_z: 0,
            dst_lod: 0,
            dst_type: 1,
            dst_host: host.as_mut_ptr().cast(),
            dst_device: 0,
            dst_array: std::ptr::null_mut(),
            dst_ctx: std::ptr::null_mut(),
            dst_pitch: 10,
            dst_height: 4,
            width: 10,
            height: 4,
            depth: 3,
        };
        assert_eq!(copy3d_async(&d3, stream), 0);
        assert_eq!(stream_sync(stream), 0);
        for k in 0..3 {
            for r in 0..4 {
                let s = ((1 + k) * 6 + 1 + r) * 33 + 2;
                assert_eq!(&host[(k * 4 + r) * 10..][..10], &slab[s..s + 10], "{k} {r}");
            }
        }
        let mut reserved = d3;
        reserved.src_ctx = 16 as *mut c_void;
        assert_eq!(copy3d(&reserved), 1, "reserved0 must be NULL");

        // Peer copies from context a's allocation to context b's.
        assert_eq!(set_current(b), 0);
        let mut pb = 0u64;
        assert_eq!(alloc(&mut pb, 4096), 0);
        assert_eq!(htod(pb, vec![0u8; 4096].as_ptr().cast(), 4096), 0);
        assert_eq!(peer(pb + 100, b, dev + 10, a, 500), 0);
        let mut got = vec![0u8; 4096];
        assert_eq!(dtoh(got.as_mut_ptr().cast(), pb, 4096), 0);
        assert_eq!(&got[100..600], &slab[10..510]);
        let mut p3 = d3;
        p3.src_ctx = a;
        p3.dst_ctx = b;
        p3.dst_type = 2;
        p3.dst_host = std::ptr::null_mut();
        p3.dst_device = pb;
        p3.dst_pitch = 16;
        p3.dst_height = 4;
        assert_eq!(copy3d_peer(&p3), 0);
        assert_eq!(dtoh(got.as_mut_ptr().cast(), pb, 4096), 0);
        for k in 0..3 {
            for r in 0..4 {
                let s = ((1 + k) * 6 + 1 + r) * 33 + 2;
                assert_eq!(
                    &got[(k * 4 + r) * 16..][..10],
                    &slab[s..s + 10],
                    "peer {k} {r}"
                );
            }
        }
    }
    println!("CHILD-OK");
}

/// Runs child test `name` against a fresh emulated server; SKIPPED without the binary.
fn emulated_child(name: &str) {
    let Some(bin) = remora_bin() else {
        println!("SKIPPED: remora binary not built (cargo build -p remora-cli)");
        return;
    };
    match serve(&bin, &["--backend", "emulated"], &[]) {
        Err(2) => println!("SKIPPED: emulated backend not available"),
        Err(code) => panic!("remora serve --backend emulated exited with {code}"),
        Ok(s) => {
            let out = in_child(name, &s.1);
            let text = String::from_utf8_lossy(&out.stdout);
            assert!(
                text.contains("CHILD-OK"),
                "{text}\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
}

#[test]
fn emulated_managed_memory() {
    emulated_child("child_managed_memory");
}

#[test]
#[ignore = "run in a child process by emulated_managed_memory"]
fn child_managed_memory() {
    if std::env::var_os("REMORA_SHIM_CHILD").is_none() {
        return;
    }
    type Attr = unsafe extern "C" fn(*mut c_int, c_int, c_int) -> c_int;
    type CtxCreate = unsafe extern "C" fn(*mut *mut c_void, c_uint, c_int) -> c_int;
    type AllocManaged = unsafe extern "C" fn(*mut u64, usize, c_uint) -> c_int;
    type Prefetch = unsafe extern "C" fn(u64, usize, c_int, *mut c_void) -> c_int;
    type Advise = unsafe extern "C" fn(u64, usize, c_int, c_int) -> c_int;
    type Memset = unsafe extern "C" fn(u64, u8, usize) -> c_int;
    type PtrAttr = unsafe extern "C" fn(*mut c_void, c_int, u64) -> c_int;
    type Free = unsafe extern "C" fn(u64) -> c_int;
    type Dtoh = unsafe extern "C" fn(*mut c_void, u64, usize) -> c_int;
    // SAFETY: loading our own shim.
    let lib = unsafe { libloading::Library::new(shim_path()) }.unwrap();
    // SAFETY: every symbol has the signature cuda.h gives it; outputs point to locals; the
    // managed allocation is touched on the host only between synchronous calls.
    unsafe {
        let init: libloading::Symbol<Init> = lib.get(b"cuInit").unwrap();
        let attr: libloading::Symbol<Attr> = lib.get(b"cuDeviceGetAttribute").unwrap();
        let ctx_create: libloading::Symbol<CtxCreate> = lib.get(b"cuCtxCreate_v2").unwrap();
        let alloc: libloading::Symbol<AllocManaged> = lib.get(b"cuMemAllocManaged").unwrap();
        let prefetch: libloading::Symbol<Prefetch> = lib.get(b"cuMemPrefetchAsync").unwrap();
        let advise: libloading::Symbol<Advise> = lib.get(b"cuMemAdvise").unwrap();
        let memset: libloading::Symbol<Memset> = lib.get(b"cuMemsetD8_v2").unwrap();
        let ptr_attr: libloading::Symbol<PtrAttr> = lib.get(b"cuPointerGetAttribute").unwrap();
        let free: libloading::Symbol<Free> = lib.get(b"cuMemFree_v2").unwrap();
        let dtoh: libloading::Symbol<Dtoh> = lib.get(b"cuMemcpyDtoH_v2").unwrap();
        assert_eq!(init(0), 0);
        // The emulated GPU has managed memory (as an H100 does), and so does Remora; concurrent
        // access and pageable-memory access are answered 0.
        let mut v: c_int = -1;
        assert_eq!(attr(&mut v, 83, 0), 0);
        assert_eq!(v, 1, "MANAGED_MEMORY is the server's answer");
        for a in [88, 89, 100, 101] {
            let mut v: c_int = -1;
            assert_eq!(attr(&mut v, a, 0), 0, "attribute {a}");
            assert_eq!(v, 0, "attribute {a} must answer 0");
        }
        let mut ctx = std::ptr::null_mut();
        assert_eq!(ctx_create(&mut ctx, 0, 0), 0);
        let mut p = 0u64;
        assert_eq!(
            alloc(&mut p, 4096, 4),
            1,
            "CU_MEM_ATTACH_SINGLE is not an allocation flag"
        );
        assert_eq!(alloc(&mut p, 10_000, 1), 0, "cuMemAllocManaged");
        let host = std::slice::from_raw_parts_mut(p as usize as *mut u8, 10_000);
        assert!(host.iter().all(|&b| b == 0));
        for (i, b) in host.iter_mut().enumerate() {
            *b = (i % 251) as u8;
        }
        // The host's bytes reach the device before a copy reads them...
        let mut got = vec![0u8; 10_000];
        assert_eq!(dtoh(got.as_mut_ptr().cast(), p, 10_000), 0);
        assert_eq!(got, host);
        // ... and the device's writes are on the host when a synchronous call returns.
        assert_eq!(memset(p + 100, 0xee, 50), 0);
        assert!(host[100..150].iter().all(|&b| b == 0xee));
        assert_eq!(host[150], 150);
        let mut managed: c_uint = 0;
        assert_eq!(ptr_attr((&mut managed as *mut c_uint).cast(), 8, p + 9), 0);
        assert_eq!(managed, 1, "CU_POINTER_ATTRIBUTE_IS_MANAGED");
        assert_eq!(prefetch(p, 10_000, 0, std::ptr::null_mut()), 0);
        assert_eq!(advise(p, 4096, 1, 0), 0);
        assert_eq!(advise(p, 4096, 99, 0), 1, "unknown advice");
        assert_eq!(advise(0x1000, 4096, 1, 0), 1, "not managed memory");
        assert_eq!(free(p), 0);
        // Through cuGetProcAddress too (the CUDA runtime's way in).
        let gpa: libloading::Symbol<GetProc> = lib.get(b"cuGetProcAddress_v2").unwrap();
        let mut f: *mut c_void = std::ptr::null_mut();
        let mut st: c_int = -1;
        assert_eq!(
            gpa(c"cuMemAllocManaged".as_ptr(), &mut f, 13000, 0, &mut st),
            0
        );
        let via: AllocManaged = std::mem::transmute(f);
        assert_eq!(via(&mut p, 4096, 1), 0);
        assert_eq!(free(p), 0);
    }
    println!("CHILD-OK");
}

#[test]
fn emulated_host_callbacks() {
    emulated_child("child_host_callbacks");
}

type HostFnC = unsafe extern "C" fn(*mut c_void);
type StreamCbC = unsafe extern "C" fn(*mut c_void, c_int, *mut c_void);

/// What the callbacks of `child_host_callbacks` saw.
#[derive(Default)]
struct Seen {
    order: Vec<u32>,
    stream: usize,
    status: c_int,
    /// What a CUDA call made from inside a callback returned.
    nested: c_int,
    count: Option<unsafe extern "C" fn(*mut c_int) -> c_int>,
    thread: Option<std::thread::ThreadId>,
}

static SEEN: std::sync::Mutex<Option<Seen>> = std::sync::Mutex::new(None);

unsafe extern "C" fn host_fn(p: *mut c_void) {
    std::thread::sleep(Duration::from_millis(30));
    let mut g = SEEN.lock().unwrap();
    let s = g.as_mut().unwrap();
    s.order.push(p as usize as u32);
    s.thread = Some(std::thread::current().id());
    if let Some(count) = s.count {
        let mut n: c_int = 0;
        // SAFETY: cuDeviceGetCount's signature; the output is a local.
        s.nested = unsafe { count(&mut n) };
    }
}

unsafe extern "C" fn stream_cb(stream: *mut c_void, status: c_int, p: *mut c_void) {
    let mut g = SEEN.lock().unwrap();
    let s = g.as_mut().unwrap();
    s.order.push(p as usize as u32);
    s.stream = stream as usize;
    s.status = status;
}

#[test]
#[ignore = "run in a child process by emulated_host_callbacks"]
fn child_host_callbacks() {
    if std::env::var_os("REMORA_SHIM_CHILD").is_none() {
        return;
    }
    type StreamCreate = unsafe extern "C" fn(*mut *mut c_void, c_uint) -> c_int;
    type StreamSync = unsafe extern "C" fn(*mut c_void) -> c_int;
    type Launch = unsafe extern "C" fn(*mut c_void, Option<HostFnC>, *mut c_void) -> c_int;
    type AddCb = unsafe extern "C" fn(*mut c_void, Option<StreamCbC>, *mut c_void, c_uint) -> c_int;
    *SEEN.lock().unwrap() = Some(Seen::default());
    // SAFETY: loading our own shim.
    let lib = unsafe { libloading::Library::new(shim_path()) }.unwrap();
    // SAFETY: every symbol has the signature cuda.h gives it; the callbacks are the functions
    // above, with user data that are plain numbers.
    unsafe {
        let count: libloading::Symbol<GetCount> = lib.get(b"cuDeviceGetCount").unwrap();
        let stream_create: libloading::Symbol<StreamCreate> = lib.get(b"cuStreamCreate").unwrap();
        let stream_sync: libloading::Symbol<StreamSync> = lib.get(b"cuStreamSynchronize").unwrap();
        let launch: libloading::Symbol<Launch> = lib.get(b"cuLaunchHostFunc").unwrap();
        let add: libloading::Symbol<AddCb> = lib.get(b"cuStreamAddCallback").unwrap();
        init_with_context(&lib);
        let mut s = std::ptr::null_mut();
        assert_eq!(stream_create(&mut s, 1), 0);
        SEEN.lock().unwrap().as_mut().unwrap().count = Some(*count);
        assert_eq!(
            launch(
                s,
                Some(host_fn),
                std::ptr::without_provenance_mut::<c_void>(1)
            ),
            0
        );
        assert_eq!(
            launch(
                s,
                Some(host_fn),
                std::ptr::without_provenance_mut::<c_void>(2)
            ),
            0
        );
        assert_eq!(
            add(
                s,
                Some(stream_cb),
                std::ptr::without_provenance_mut::<c_void>(3),
                0
            ),
            0
        );
        assert_eq!(stream_sync(s), 0);
        {
            let g = SEEN.lock().unwrap();
            let seen = g.as_ref().unwrap();
            assert_eq!(
                seen.order,
                [1, 2, 3],
                "in stream order, before the synchronize returned"
            );
            assert_eq!(
                seen.stream, s as usize,
                "the stream as the application named it"
            );
            assert_eq!(seen.status, 0);
            assert_eq!(
                seen.nested, 800,
                "CUDA calls from a callback: CUDA_ERROR_NOT_PERMITTED"
            );
            assert_ne!(seen.thread, Some(std::thread::current().id()));
        }
        // Invalid arguments, as CUDA checks them.
        assert_eq!(launch(s, None, std::ptr::null_mut()), 1);
        assert_eq!(add(s, Some(stream_cb), std::ptr::null_mut(), 1), 1);
        // The legacy stream: NULL is passed back.
        assert_eq!(
            add(
                std::ptr::null_mut(),
                Some(stream_cb),
                std::ptr::without_provenance_mut::<c_void>(4),
                0
            ),
            0
        );
        assert_eq!(stream_sync(std::ptr::null_mut()), 0);
        let g = SEEN.lock().unwrap();
        assert_eq!(g.as_ref().unwrap().order, [1, 2, 3, 4]);
        assert_eq!(g.as_ref().unwrap().stream, 0);
    }
    println!("CHILD-OK");
}

#[test]
fn emulated_tools_tables() {
    emulated_child("child_tools_tables");
}

/// The function visitor of TOOLS_MODULE slot 7: records (function, name).
unsafe extern "C" fn visit_function(user: *mut c_void, f: *mut c_void, name: *const i8) {
    // SAFETY: `user` is the test's Vec, borrowed by nobody else during the call.
    let seen = unsafe { &mut *user.cast::<Vec<(usize, String)>>() };
    // SAFETY: the shim passes the function's NUL-terminated name.
    let name = unsafe { std::ffi::CStr::from_ptr(name) };
    seen.push((f as usize, name.to_string_lossy().into_owned()));
}

#[test]
#[ignore = "run in a child process by emulated_tools_tables"]
fn child_tools_tables() {
    if std::env::var_os("REMORA_SHIM_CHILD").is_none() {
        return;
    }
    type ExportTable = unsafe extern "C" fn(*mut *const *const c_void, *const [u8; 16]) -> c_int;
    type ModuleLoadData = unsafe extern "C" fn(*mut *mut c_void, *const c_void) -> c_int;
    type GetFunction = unsafe extern "C" fn(*mut *mut c_void, *mut c_void, *const i8) -> c_int;
    type Object = unsafe extern "C" fn(*mut c_void, *mut c_void, *mut *mut c_void) -> c_int;
    type Ask = unsafe extern "C" fn(*mut c_void, *mut c_void, *mut u64, u64, u64) -> c_int;
    type StreamCreate = unsafe extern "C" fn(*mut *mut c_void, u32) -> c_int;
    type Each = unsafe extern "C" fn(
        *mut c_void,
        *mut c_void,
        Option<unsafe extern "C" fn(*mut c_void, *mut c_void, *const i8)>,
        *mut c_void,
    ) -> c_int;
    const TOOLS_CONTEXT: [u8; 16] = [
        0x21, 0x31, 0x8c, 0x60, 0x97, 0x14, 0x32, 0x48, 0x8c, 0xa6, 0x41, 0xff, 0x73, 0x24, 0xc8,
        0xf2,
    ];
    const TOOLS_MODULE: [u8; 16] = [
        0x6e, 0x16, 0x3f, 0xbe, 0xb9, 0x58, 0x44, 0x4d, 0x83, 0x5c, 0xe1, 0x82, 0xaf, 0xf1, 0x99,
        0x1e,
    ];
    // SAFETY: loading our own shim.
    let lib = unsafe { libloading::Library::new(shim_path()) }.unwrap();
    // SAFETY: every symbol has the signature cuda.h gives it, every table slot the signature
    // docs/export-tables.md gives it; outputs point to locals.
    unsafe {
        let export: libloading::Symbol<ExportTable> = lib.get(b"cuGetExportTable").unwrap();
        let load: libloading::Symbol<ModuleLoadData> = lib.get(b"cuModuleLoadData").unwrap();
        let get_fn: libloading::Symbol<GetFunction> = lib.get(b"cuModuleGetFunction").unwrap();
        let ctx = init_with_context(&lib);

        // TOOLS_CONTEXT slots 51 and 39, as cuBLASLt calls them.
        let mut t: *const *const c_void = std::ptr::null();
        assert_eq!(export(&mut t, &TOOLS_CONTEXT), 0);
        assert_eq!(*t as usize, 95 * 8);
        let object: Object = std::mem::transmute(*t.add(51));
        let ask: Ask = std::mem::transmute(*t.add(39));
        let null = std::ptr::null_mut();
        let mut obj = std::ptr::null_mut();
        assert_eq!(object(ctx, null, &mut obj), 0);
        assert!(!obj.is_null());
        let mut again = std::ptr::null_mut();
        assert_eq!(
            object(std::ptr::null_mut(), null, &mut again),
            0,
            "null = current context"
        );
        assert_eq!(again, obj, "one object per context and stream");
        let mut answer: u64 = 0xdead_beef_0000_dead;
        assert_eq!(ask(ctx, obj, &mut answer, 0x7fff_fffe_ffff, 1), 0);
        assert_eq!(
            answer, 0,
            "the emulated device answers 0, in the whole cell"
        );
        assert_eq!(
            ask(ctx, 0x1234 as *mut c_void, &mut answer, 0, 1),
            1,
            "an object slot 51 did not hand out"
        );
        assert_eq!(
            ask(ctx, obj, &mut answer, 0x1234, 0xdead_be00_0000_002a),
            0,
            "mask and flag may be register leftovers: never refused"
        );
        // Slot 51 about a created stream (as cuBLAS asks for reductions on one): another
        // object, asked through RM_TOOLS_STREAM_QUERY.
        let create: libloading::Symbol<StreamCreate> = lib.get(b"cuStreamCreate").unwrap();
        let mut stream = std::ptr::null_mut();
        assert_eq!(create(&mut stream, 1), 0);
        let mut sobj = std::ptr::null_mut();
        assert_eq!(object(ctx, stream, &mut sobj), 0);
        assert!(!sobj.is_null() && sobj != obj, "one object per stream");
        answer = 0xdead;
        assert_eq!(ask(ctx, sobj, &mut answer, 0x7fff_fffe_ffff, 0), 0);
        assert_eq!(answer, 0);
        assert_eq!(
            object(ctx, 5 as *mut c_void, &mut sobj),
            400,
            "a stream handle that names nothing"
        );

        // TOOLS_MODULE slot 7 visits every function of a module.
        let mut t: *const *const c_void = std::ptr::null();
        assert_eq!(export(&mut t, &TOOLS_MODULE), 0);
        assert_eq!(*t as usize, 99 * 8);
        let each: Each = std::mem::transmute(*t.add(7));
        let image = c"REMORA-EMU-MODULE\nfunc zeta 8\nfunc alpha 4,4\n";
        let mut module = std::ptr::null_mut();
        assert_eq!(load(&mut module, image.as_ptr().cast()), 0);
        let mut seen: Vec<(usize, String)> = Vec::new();
        let n = each(
            ctx,
            module,
            Some(visit_function),
            (&raw mut seen).cast::<c_void>(),
        );
        assert_eq!(n, 2, "two functions visited");
        let names: Vec<&str> = seen.iter().map(|(_, n)| n.as_str()).collect();
        assert_eq!(names, ["alpha", "zeta"]);
        for (f, name) in &seen {
            let mut g = std::ptr::null_mut();
            let c = std::ffi::CString::new(name.as_str()).unwrap();
            assert_eq!(get_fn(&mut g, module, c.as_ptr()), 0);
            assert_eq!(
                g as usize, *f,
                "the visited handle is cuModuleGetFunction's"
            );
        }
        assert_eq!(
            each(
                ctx,
                0x99 as *mut c_void,
                Some(visit_function),
                std::ptr::null_mut()
            ),
            400,
            "an unknown module"
        );
        // An unimplemented slot of the new table is a loud trap.
        let trap: unsafe extern "C" fn() -> c_int = std::mem::transmute(*t.add(98));
        assert_eq!(trap(), 801);
    }
    println!("CHILD-OK");
}

#[test]
fn emulated_pointer_attributes() {
    emulated_child("child_pointer_attributes");
}

#[test]
#[ignore = "run in a child process by emulated_pointer_attributes"]
fn child_pointer_attributes() {
    if std::env::var_os("REMORA_SHIM_CHILD").is_none() {
        return;
    }
    type Alloc = unsafe extern "C" fn(*mut u64, usize) -> c_int;
    type Free = unsafe extern "C" fn(u64) -> c_int;
    type Attr = unsafe extern "C" fn(*mut c_void, c_int, u64) -> c_int;
    // SAFETY: loading our own shim.
    let lib = unsafe { libloading::Library::new(shim_path()) }.unwrap();
    // SAFETY: every symbol has the signature cuda.h gives it; outputs point to locals of the
    // attribute's type.
    unsafe {
        let alloc: libloading::Symbol<Alloc> = lib.get(b"cuMemAlloc_v2").unwrap();
        let free: libloading::Symbol<Free> = lib.get(b"cuMemFree_v2").unwrap();
        let attr: libloading::Symbol<Attr> = lib.get(b"cuPointerGetAttribute").unwrap();
        init_with_context(&lib);
        let (mut a, mut b) = (0u64, 0u64);
        assert_eq!(alloc(&mut a, 4096), 0);
        assert_eq!(alloc(&mut b, 4096), 0);
        let id = |p: u64| {
            let mut v = 0u64;
            assert_eq!(attr((&raw mut v).cast(), 7, p), 0, "buffer id of {p:#x}");
            v
        };
        let (ia, ib) = (id(a), id(b));
        assert!(ia != 0 && ib != 0 && ia != ib, "ids {ia} {ib}");
        assert_eq!(
            id(a + 100),
            ia,
            "an interior pointer has its allocation's id"
        );
        let mut kind: c_uint = 0;
        assert_eq!(attr((&raw mut kind).cast(), 2, a + 8), 0);
        assert_eq!(kind, 2, "CU_MEMORYTYPE_DEVICE");
        let mut start = 0u64;
        assert_eq!(attr((&raw mut start).cast(), 11, a + 8), 0);
        assert_eq!(start, a);
        let mut host: *mut c_void = std::ptr::null_mut();
        assert_eq!(
            attr((&raw mut host).cast(), 4, a + 8),
            1,
            "HOST_POINTER of device memory: CUDA_ERROR_INVALID_VALUE, as the driver answers"
        );
        assert_eq!(free(a), 0);
        let mut c = 0u64;
        assert_eq!(alloc(&mut c, 4096), 0);
        let ic = id(c);
        assert!(ic != ia && ic != ib, "ids are never reused");
    }
    println!("CHILD-OK");
}

#[test]
fn emulated_kernel_launches() {
    emulated_child("child_kernel_launches");
}

/// `struct Mixed { char c; double d; int i; short s; }` of gpu/tests/multikernel_kernel.cu.
#[repr(C)]
struct Mixed {
    c: i8,
    d: f64,
    i: i32,
    s: i16,
}

#[test]
#[ignore = "run in a child process by emulated_kernel_launches"]
fn child_kernel_launches() {
    if std::env::var_os("REMORA_SHIM_CHILD").is_none() {
        return;
    }
    type ModuleLoadData = unsafe extern "C" fn(*mut *mut c_void, *const c_void) -> c_int;
    type GetFunction = unsafe extern "C" fn(*mut *mut c_void, *mut c_void, *const i8) -> c_int;
    type Alloc = unsafe extern "C" fn(*mut u64, usize) -> c_int;
    type Htod = unsafe extern "C" fn(u64, *const c_void, usize) -> c_int;
    type Dtoh = unsafe extern "C" fn(*mut c_void, u64, usize) -> c_int;
    type StreamCreate = unsafe extern "C" fn(*mut *mut c_void, c_uint) -> c_int;
    type Sync = unsafe extern "C" fn(*mut c_void) -> c_int;
    type CtxSync = unsafe extern "C" fn() -> c_int;
    type Launch = unsafe extern "C" fn(
        *mut c_void,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        *mut c_void,
        *mut *mut c_void,
        *mut *mut c_void,
    ) -> c_int;
    // The kernels' signatures, as the emulated test format spells them.
    let image = c"REMORA-EMU-MODULE
func vecadd 8,8,8,4
func fill_i32 8,4,4
func saxpy 4,8,8,4
func small_types 1,2,1,8,8,4
func by_struct 24,8
func many_params 4,8,4,8,1,2,4,8,4,8,8,4
func grid3d 8
func large_param 8192,8
func not_a_test_kernel 8
";
    // SAFETY: loading our own shim.
    let lib = unsafe { libloading::Library::new(shim_path()) }.unwrap();
    // SAFETY: every symbol has the signature cuda.h gives it; kernel parameters point to
    // locals of the types the kernels take; outputs point to locals or vectors of the size
    // copied.
    unsafe {
        let load: libloading::Symbol<ModuleLoadData> = lib.get(b"cuModuleLoadData").unwrap();
        let get_fn: libloading::Symbol<GetFunction> = lib.get(b"cuModuleGetFunction").unwrap();
        let alloc: libloading::Symbol<Alloc> = lib.get(b"cuMemAlloc_v2").unwrap();
        let htod: libloading::Symbol<Htod> = lib.get(b"cuMemcpyHtoD_v2").unwrap();
        let dtoh: libloading::Symbol<Dtoh> = lib.get(b"cuMemcpyDtoH_v2").unwrap();
        let stream_create: libloading::Symbol<StreamCreate> = lib.get(b"cuStreamCreate").unwrap();
        let stream_sync: libloading::Symbol<Sync> = lib.get(b"cuStreamSynchronize").unwrap();
        let ctx_sync: libloading::Symbol<CtxSync> = lib.get(b"cuCtxSynchronize").unwrap();
        let launch: libloading::Symbol<Launch> = lib.get(b"cuLaunchKernel").unwrap();
        init_with_context(&lib);
        let mut module = std::ptr::null_mut();
        assert_eq!(load(&mut module, image.as_ptr().cast()), 0);
        let f = |name: &std::ffi::CStr| {
            let mut h = std::ptr::null_mut();
            assert_eq!(get_fn(&mut h, module, name.as_ptr()), 0, "{name:?}");
            h
        };
        let dev = |bytes: usize| {
            let mut p = 0u64;
            assert_eq!(alloc(&mut p, bytes), 0);
            p
        };
        let read = |p: u64, bytes: usize| {
            let mut v = vec![0u8; bytes];
            assert_eq!(dtoh(v.as_mut_ptr().cast(), p, bytes), 0);
            v
        };
        let null: *mut c_void = std::ptr::null_mut();
        let none: *mut *mut c_void = std::ptr::null_mut();
        let mut s = std::ptr::null_mut();
        assert_eq!(stream_create(&mut s, 1), 0);

        // Stream order and kernelParams: fill_i32 writes a, vecadd reads it, same stream.
        let n: c_int = 1000;
        let (a, b, c) = (dev(4000), dev(4000), dev(4000));
        let bs: Vec<f32> = (0..n).map(|i| i as f32 * 0.5).collect();
        assert_eq!(htod(b, bs.as_ptr().cast(), 4000), 0);
        let (mut pa, mut v) = (a, 7 as c_int);
        let mut nn = n;
        let mut args = [
            (&raw mut pa).cast::<c_void>(),
            (&raw mut v).cast(),
            (&raw mut nn).cast(),
        ];
        assert_eq!(
            launch(
                f(c"fill_i32"),
                4,
                1,
                1,
                256,
                1,
                1,
                0,
                s,
                args.as_mut_ptr(),
                none
            ),
            0
        );
        // fill_i32 wrote ints; vecadd reads them as floats: the check below knows.
        let (mut x, mut y, mut z) = (a, b, c);
        let mut args = [
            (&raw mut x).cast::<c_void>(),
            (&raw mut y).cast(),
            (&raw mut z).cast(),
            (&raw mut nn).cast(),
        ];
        assert_eq!(
            launch(
                f(c"vecadd"),
                4,
                1,
                1,
                256,
                1,
                1,
                0,
                s,
                args.as_mut_ptr(),
                none
            ),
            0
        );
        assert_eq!(stream_sync(s), 0);
        let got = read(c, 4000);
        for i in 0..n as usize {
            let want = f32::from_bits((7 + i as u32).to_le()) + bs[i];
            let v = f32::from_le_bytes(got[i * 4..i * 4 + 4].try_into().unwrap());
            assert_eq!(v.to_bits(), want.to_bits(), "vecadd element {i}");
        }

        // `extra` (CU_LAUNCH_PARAM_BUFFER_POINTER/SIZE/END) for saxpy(float a, x, y, int n).
        let mut buf = [0u8; 32];
        buf[0..4].copy_from_slice(&2.0f32.to_le_bytes());
        buf[8..16].copy_from_slice(&b.to_le_bytes());
        buf[16..24].copy_from_slice(&c.to_le_bytes());
        buf[24..28].copy_from_slice(&n.to_le_bytes());
        let mut size: usize = 28;
        let mut extra = [
            std::ptr::without_provenance_mut::<c_void>(1),
            buf.as_mut_ptr().cast(),
            std::ptr::without_provenance_mut::<c_void>(2),
            (&raw mut size).cast(),
            none.cast(),
        ];
        assert_eq!(
            launch(
                f(c"saxpy"),
                8,
                1,
                1,
                128,
                1,
                1,
                0,
                s,
                none,
                extra.as_mut_ptr()
            ),
            0
        );
        assert_eq!(stream_sync(s), 0);
        let after = read(c, 4000);
        for i in 0..n as usize {
            let before = f32::from_le_bytes(got[i * 4..i * 4 + 4].try_into().unwrap());
            let v = f32::from_le_bytes(after[i * 4..i * 4 + 4].try_into().unwrap());
            assert_eq!(
                v.to_bits(),
                (2.0 * bs[i] + before).to_bits(),
                "saxpy element {i}"
            );
        }

        // Small scalar widths, a struct by value, twelve parameters.
        let (pc, ps) = (dev(64), dev(128));
        let (mut c8, mut s16, mut u8v, mut ppc, mut pps, mut n64) =
            (-5i8, 300i16, 7u8, pc, ps, 64 as c_int);
        let mut args = [
            (&raw mut c8).cast::<c_void>(),
            (&raw mut s16).cast(),
            (&raw mut u8v).cast(),
            (&raw mut ppc).cast(),
            (&raw mut pps).cast(),
            (&raw mut n64).cast(),
        ];
        assert_eq!(
            launch(
                f(c"small_types"),
                1,
                1,
                1,
                64,
                1,
                1,
                0,
                null,
                args.as_mut_ptr(),
                none
            ),
            0
        );
        let mut m = Mixed {
            c: -3,
            d: 2.5,
            i: 40,
            s: -7,
        };
        let out = dev(16);
        let mut pout = out;
        let mut args = [(&raw mut m).cast::<c_void>(), (&raw mut pout).cast()];
        assert_eq!(
            launch(
                f(c"by_struct"),
                1,
                1,
                1,
                1,
                1,
                1,
                0,
                null,
                args.as_mut_ptr(),
                none
            ),
            0
        );
        let (p1, p2) = (dev(8), dev(8));
        let (
            mut ia,
            mut lb,
            mut fc,
            mut dd,
            mut ce,
            mut sf,
            mut ug,
            mut uh,
            mut fi,
            mut pp1,
            mut pp2,
            mut ij,
        ) = (
            1i32,
            1i64 << 33 | 2,
            0.25f32,
            0.5f64,
            -4i8,
            9i16,
            11u32,
            13u64,
            0.125f32,
            p1,
            p2,
            17i32,
        );
        let mut args = [
            (&raw mut ia).cast::<c_void>(),
            (&raw mut lb).cast(),
            (&raw mut fc).cast(),
            (&raw mut dd).cast(),
            (&raw mut ce).cast(),
            (&raw mut sf).cast(),
            (&raw mut ug).cast(),
            (&raw mut uh).cast(),
            (&raw mut fi).cast(),
            (&raw mut pp1).cast(),
            (&raw mut pp2).cast(),
            (&raw mut ij).cast(),
        ];
        assert_eq!(
            launch(
                f(c"many_params"),
                1,
                1,
                1,
                1,
                1,
                1,
                0,
                null,
                args.as_mut_ptr(),
                none
            ),
            0
        );
        // A 3-D grid of 3-D blocks.
        let (g, bl) = ([2u32, 3, 2], [4u32, 2, 2]);
        let total = (g.iter().product::<u32>() * bl.iter().product::<u32>()) as usize;
        let grid = dev(total * 4);
        let mut pg = grid;
        let mut args = [(&raw mut pg).cast::<c_void>()];
        assert_eq!(
            launch(
                f(c"grid3d"),
                g[0],
                g[1],
                g[2],
                bl[0],
                bl[1],
                bl[2],
                0,
                null,
                args.as_mut_ptr(),
                none
            ),
            0
        );
        // A parameter of 8 KiB (more than the 4 KiB of old CUDA; CUDA 12.1+ allows 32,764
        // bytes in all): the kernel sums its words.
        let mut big: Vec<u32> = (0..2048u32)
            .map(|i| i.wrapping_mul(2_654_435_761))
            .collect();
        let want: u64 = big.iter().map(|&w| u64::from(w)).sum();
        let big_out = dev(8);
        let mut pbig = big_out;
        let mut args = [big.as_mut_ptr().cast::<c_void>(), (&raw mut pbig).cast()];
        assert_eq!(
            launch(
                f(c"large_param"),
                1,
                1,
                1,
                1,
                1,
                1,
                0,
                null,
                args.as_mut_ptr(),
                none
            ),
            0,
            "an 8 KiB kernel parameter"
        );
        assert_eq!(ctx_sync(), 0);
        let got = u64::from_le_bytes(read(big_out, 8).try_into().unwrap());
        assert_eq!(got, want, "large_param sum");
        let pcv = read(pc, 64);
        let psv = read(ps, 128);
        for i in 0..64usize {
            assert_eq!(
                pcv[i] as i8,
                (-5i8).wrapping_add(i as i8),
                "small_types pc[{i}]"
            );
            let s = i16::from_le_bytes([psv[2 * i], psv[2 * i + 1]]);
            assert_eq!(
                s,
                300i16.wrapping_mul(i as i16).wrapping_add(7),
                "small_types ps[{i}]"
            );
        }
        let d = f64::from_le_bytes(read(out, 8).try_into().unwrap());
        assert_eq!(d, -3.0 + 2.5 + 40.0 - 7.0, "struct by value");
        let s1 = i32::from_le_bytes(read(p1, 4).try_into().unwrap());
        assert_eq!(s1, 1 + 2 - 4 + 9 + 11 + 13 + 17, "twelve parameters (ints)");
        let s2 = f64::from_le_bytes(read(p2, 8).try_into().unwrap());
        assert_eq!(s2, 0.25 + 0.5 + 0.125, "twelve parameters (floats)");
        let gv = read(grid, total * 4);
        let mut seen = std::collections::HashSet::new();
        for id in 0..total {
            let v = u32::from_le_bytes(gv[id * 4..id * 4 + 4].try_into().unwrap());
            assert!(
                seen.insert(v),
                "grid3d: thread {id} wrote a duplicate {v:#x}"
            );
        }
        assert_eq!(seen.len(), total, "every thread of the 3-D grid ran once");

        // A kernel the emulated backend does not implement: the launch is one-way, its error
        // comes at the next synchronizing call.
        let mut p = pc;
        let mut args = [(&raw mut p).cast::<c_void>()];
        assert_eq!(
            launch(
                f(c"not_a_test_kernel"),
                1,
                1,
                1,
                1,
                1,
                1,
                0,
                null,
                args.as_mut_ptr(),
                none
            ),
            0
        );
        assert_eq!(
            ctx_sync(),
            801,
            "CUDA_ERROR_NOT_SUPPORTED at the synchronize"
        );
    }
    println!("CHILD-OK");
}

// Driver calls from exit handlers and thread-local destructors -----------------------------

type GetCurrent = unsafe extern "C" fn(*mut *mut c_void) -> c_int;
type CtxSync = unsafe extern "C" fn() -> c_int;

static GET_CURRENT: std::sync::OnceLock<GetCurrent> = std::sync::OnceLock::new();
static CTX_SYNC: std::sync::OnceLock<CtxSync> = std::sync::OnceLock::new();
static FROM_KEY_DTOR: std::sync::Mutex<Option<(c_int, c_int)>> = std::sync::Mutex::new(None);

unsafe extern "C" {
    fn atexit(f: extern "C" fn()) -> c_int;
    fn pthread_key_create(
        key: *mut c_uint,
        dtor: Option<unsafe extern "C" fn(*mut c_void)>,
    ) -> c_int;
    fn pthread_setspecific(key: c_uint, value: *const c_void) -> c_int;
}

/// Calls two entry points the CUDA runtime calls while it shuts down.
fn calls_at_shutdown() -> (c_int, c_int) {
    let mut ctx = std::ptr::null_mut();
    // SAFETY: the shim's entry points (loaded and leaked by the child), an output local.
    unsafe {
        (
            GET_CURRENT.get().unwrap()(&mut ctx),
            CTX_SYNC.get().unwrap()(),
        )
    }
}

extern "C" fn at_exit() {
    let (a, b) = calls_at_shutdown();
    // Plain writes: std's stdout may be gone by now.
    let line = format!("AT-EXIT {a} {b}\n");
    // SAFETY: writes a buffer to fd 1.
    unsafe {
        unsafe extern "C" {
            fn write(fd: c_int, buf: *const c_void, n: usize) -> isize;
        }
        write(1, line.as_ptr().cast(), line.len());
    }
}

unsafe extern "C" fn key_dtor(_: *mut c_void) {
    *FROM_KEY_DTOR.lock().unwrap() = Some(calls_at_shutdown());
}

/// What CUDA answers while it shuts down (or a thread's state is gone): anything but a panic
/// turned into CUDA_ERROR_UNKNOWN (999).
fn acceptable_at_shutdown(rc: c_int) -> bool {
    [0, 4, 201].contains(&rc)
}

#[test]
fn driver_calls_from_exit_handlers_and_thread_destructors_do_not_panic() {
    let Some(bin) = remora_bin() else {
        println!("SKIPPED: remora binary not built (cargo build -p remora-cli)");
        return;
    };
    let s = serve(&bin, &["--backend", "emulated"], &[]).expect("emulated server");
    let out = in_child("child_calls_at_shutdown", &s.1);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("CHILD-OK"),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = text
        .lines()
        .find(|l| l.starts_with("AT-EXIT "))
        .unwrap_or_else(|| panic!("the exit handler did not run: {text}"));
    for rc in line.split_whitespace().skip(1) {
        let rc: c_int = rc.parse().unwrap();
        assert!(acceptable_at_shutdown(rc), "from atexit: {line}");
    }
    assert!(out.status.success(), "{:?}", out.status);
}

#[test]
#[ignore = "run in a child process by driver_calls_from_exit_handlers_and_thread_destructors_do_not_panic"]
fn child_calls_at_shutdown() {
    if std::env::var_os("REMORA_SHIM_CHILD").is_none() {
        return;
    }
    // SAFETY: loading our own shim; leaked, so that the exit handler can still call it.
    let lib: &'static libloading::Library = Box::leak(Box::new(
        unsafe { libloading::Library::new(shim_path()) }.unwrap(),
    ));
    // SAFETY: every symbol has the signature cuda.h gives it; outputs point to locals; the
    // thread-specific value is a dummy non-null pointer never dereferenced.
    unsafe {
        let _ = GET_CURRENT.set(*lib.get::<GetCurrent>(b"cuCtxGetCurrent").unwrap());
        let _ = CTX_SYNC.set(*lib.get::<CtxSync>(b"cuCtxSynchronize").unwrap());
        let ctx = init_with_context(lib);
        assert_eq!(atexit(at_exit), 0);
        // A thread that made a context current exits; a pthread key destructor calls the
        // driver after (or while) the thread's own thread-local state goes.
        let mut key: c_uint = 0;
        assert_eq!(pthread_key_create(&mut key, Some(key_dtor)), 0);
        let ctx_addr = ctx as usize;
        std::thread::spawn(move || {
            let set: libloading::Symbol<unsafe extern "C" fn(*mut c_void) -> c_int> =
                lib.get(b"cuCtxSetCurrent").unwrap();
            assert_eq!(set(std::ptr::without_provenance_mut(ctx_addr)), 0);
            assert_eq!(pthread_setspecific(key, std::ptr::dangling::<c_void>()), 0);
        })
        .join()
        .unwrap();
    }
    let (a, b) = FROM_KEY_DTOR
        .lock()
        .unwrap()
        .expect("the key destructor ran");
    assert!(
        acceptable_at_shutdown(a) && acceptable_at_shutdown(b),
        "from a pthread key destructor: {a} {b}"
    );
    println!("CHILD-OK");
}

#[test]
fn emulated_module_load_from_a_file() {
    emulated_child("child_module_load_file");
}

#[test]
#[ignore = "run in a child process by emulated_module_load_from_a_file"]
fn child_module_load_file() {
    if std::env::var_os("REMORA_SHIM_CHILD").is_none() {
        return;
    }
    type CtxCreate = unsafe extern "C" fn(*mut *mut c_void, c_uint, c_int) -> c_int;
    type ModuleLoad = unsafe extern "C" fn(*mut *mut c_void, *const i8) -> c_int;
    type GetFunction = unsafe extern "C" fn(*mut *mut c_void, *mut c_void, *const i8) -> c_int;
    type IsLoaded = unsafe extern "C" fn(*mut c_int, *mut c_void) -> c_int;
    type FuncLoad = unsafe extern "C" fn(*mut c_void) -> c_int;
    let dir = tempfile::tempdir().unwrap();
    // A text image without its NUL terminator, as a PTX file on disk is.
    let file = dir.path().join("kernels.ptx");
    std::fs::write(&file, "REMORA-EMU-MODULE\nfunc vecadd 8,8,8,4\n").unwrap();
    let path = std::ffi::CString::new(file.to_str().unwrap()).unwrap();
    let missing = std::ffi::CString::new(dir.path().join("nope.cubin").to_str().unwrap()).unwrap();
    // SAFETY: loading our own shim.
    let lib = unsafe { libloading::Library::new(shim_path()) }.unwrap();
    // SAFETY: every symbol has the signature cuda.h gives it; outputs point to locals; paths
    // are NUL-terminated.
    unsafe {
        let init: libloading::Symbol<Init> = lib.get(b"cuInit").unwrap();
        let ctx_create: libloading::Symbol<CtxCreate> = lib.get(b"cuCtxCreate_v2").unwrap();
        let load: libloading::Symbol<ModuleLoad> = lib.get(b"cuModuleLoad").unwrap();
        let get_fn: libloading::Symbol<GetFunction> = lib.get(b"cuModuleGetFunction").unwrap();
        assert_eq!(init(0), 0);
        let mut ctx = std::ptr::null_mut();
        assert_eq!(ctx_create(&mut ctx, 0, 0), 0);
        let mut module = std::ptr::null_mut();
        assert_eq!(load(&mut module, path.as_ptr()), 0, "cuModuleLoad");
        let mut f = std::ptr::null_mut();
        assert_eq!(get_fn(&mut f, module, c"vecadd".as_ptr()), 0);
        assert!(!f.is_null());
        // A function got from its module is loaded (as natively); cuFuncLoad of it succeeds
        // and a handle that is no function is refused.
        let is_loaded: libloading::Symbol<IsLoaded> = lib.get(b"cuFuncIsLoaded").unwrap();
        let func_load: libloading::Symbol<FuncLoad> = lib.get(b"cuFuncLoad").unwrap();
        let mut state: c_int = -1;
        assert_eq!(is_loaded(&mut state, f), 0, "cuFuncIsLoaded");
        assert_eq!(state, 1, "CU_FUNCTION_LOADING_STATE_LOADED");
        assert_eq!(func_load(f), 0, "cuFuncLoad");
        assert_eq!(
            func_load(std::ptr::null_mut()),
            400,
            "CUDA_ERROR_INVALID_HANDLE"
        );
        assert_eq!(
            is_loaded(std::ptr::null_mut(), f),
            1,
            "CUDA_ERROR_INVALID_VALUE"
        );
        assert_eq!(
            load(&mut module, missing.as_ptr()),
            301,
            "CUDA_ERROR_FILE_NOT_FOUND, as the driver answers"
        );
        assert_eq!(load(&mut module, std::ptr::null()), 1);
    }
    println!("CHILD-OK");
}

/// `cuInit(0)` and `cuCtxCreate_v2` through `lib`, asserting both succeed: the context.
///
/// # Safety
/// `lib` is the Remora shim.
unsafe fn init_with_context(lib: &libloading::Library) -> *mut c_void {
    type CtxCreate = unsafe extern "C" fn(*mut *mut c_void, c_uint, c_int) -> c_int;
    // SAFETY: the symbols have the signatures cuda.h gives them; the output is a local.
    unsafe {
        let init: libloading::Symbol<Init> = lib.get(b"cuInit").unwrap();
        let ctx_create: libloading::Symbol<CtxCreate> = lib.get(b"cuCtxCreate_v2").unwrap();
        assert_eq!(init(0), 0);
        let mut ctx = std::ptr::null_mut();
        assert_eq!(ctx_create(&mut ctx, 0, 0), 0);
        ctx
    }
}

#[test]
fn lost_server_is_device_unavailable_with_its_cause() {
    let Some(bin) = remora_bin() else {
        println!("SKIPPED: remora binary not built (cargo build -p remora-cli)");
        return;
    };
    let s = match serve(&bin, &["--backend", "emulated"], &[]) {
        Err(2) => return println!("SKIPPED: emulated backend not available"),
        Err(code) => panic!("remora serve --backend emulated exited with {code}"),
        Ok(s) => s,
    };
    let pid = s.0.id().to_string();
    let out = in_child_with(
        "child_lost_server",
        &s.1,
        &[("REMORA_TEST_SERVER_PID", pid.as_str())],
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("CHILD-OK"),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
#[ignore = "run in a child process by lost_server_is_device_unavailable_with_its_cause"]
fn child_lost_server() {
    let Some(pid) = std::env::var_os("REMORA_TEST_SERVER_PID") else {
        return;
    };
    type Alloc = unsafe extern "C" fn(*mut u64, usize) -> c_int;
    type ErrorString = unsafe extern "C" fn(c_int, *mut *const i8) -> c_int;
    // SAFETY: loading our own shim.
    let lib = unsafe { libloading::Library::new(shim_path()) }.unwrap();
    // SAFETY: every symbol has the signature cuda.h gives it; outputs point to locals.
    unsafe {
        let alloc: libloading::Symbol<Alloc> = lib.get(b"cuMemAlloc_v2").unwrap();
        let error_string: libloading::Symbol<ErrorString> = lib.get(b"cuGetErrorString").unwrap();
        init_with_context(&lib);
        let mut p = 0u64;
        assert_eq!(alloc(&mut p, 4096), 0);
        let mut text = std::ptr::null();
        assert_eq!(error_string(46, &mut text), 0);
        let plain = std::ffi::CStr::from_ptr(text)
            .to_string_lossy()
            .into_owned();
        assert!(!plain.contains("Remora"), "no failure yet: {plain}");
        let killed = Command::new("kill")
            .args(["-KILL", pid.to_str().unwrap()])
            .status()
            .unwrap();
        assert!(killed.success());
        std::thread::sleep(Duration::from_millis(200));
        assert_eq!(
            alloc(&mut p, 4096),
            46,
            "a lost server is CUDA_ERROR_DEVICE_UNAVAILABLE"
        );
        assert_eq!(error_string(46, &mut text), 0);
        let with_cause = std::ffi::CStr::from_ptr(text)
            .to_string_lossy()
            .into_owned();
        assert!(
            with_cause.starts_with(&plain) && with_cause.contains("Remora: RM_MEM_ALLOC"),
            "cuGetErrorString keeps the cause: {with_cause}"
        );
        // Other codes keep their plain text.
        assert_eq!(error_string(1, &mut text), 0);
        assert!(
            !std::ffi::CStr::from_ptr(text)
                .to_string_lossy()
                .contains("Remora")
        );
    }
    println!("CHILD-OK");
}

#[test]
fn emulated_event_record_with_flags() {
    emulated_child("child_event_record_with_flags");
}

#[test]
#[ignore = "run in a child process by emulated_event_record_with_flags"]
fn child_event_record_with_flags() {
    if std::env::var_os("REMORA_SHIM_CHILD").is_none() {
        return;
    }
    type EventCreate = unsafe extern "C" fn(*mut *mut c_void, c_uint) -> c_int;
    type RecordWithFlags = unsafe extern "C" fn(*mut c_void, *mut c_void, c_uint) -> c_int;
    type EventSync = unsafe extern "C" fn(*mut c_void) -> c_int;
    // SAFETY: loading our own shim.
    let lib = unsafe { libloading::Library::new(shim_path()) }.unwrap();
    // SAFETY: every symbol has the signature cuda.h gives it; outputs point to locals.
    unsafe {
        let event_create: libloading::Symbol<EventCreate> = lib.get(b"cuEventCreate").unwrap();
        let record: libloading::Symbol<RecordWithFlags> =
            lib.get(b"cuEventRecordWithFlags").unwrap();
        let record_ptsz: libloading::Symbol<RecordWithFlags> =
            lib.get(b"cuEventRecordWithFlags_ptsz").unwrap();
        let sync: libloading::Symbol<EventSync> = lib.get(b"cuEventSynchronize").unwrap();
        init_with_context(&lib);
        let mut ev = std::ptr::null_mut();
        assert_eq!(event_create(&mut ev, 0), 0);
        assert_eq!(
            record(ev, std::ptr::null_mut(), 0),
            0,
            "default flag records"
        );
        assert_eq!(sync(ev), 0);
        assert_eq!(record_ptsz(ev, std::ptr::null_mut(), 0), 0);
        assert_eq!(sync(ev), 0);
        assert_eq!(
            record(ev, std::ptr::null_mut(), 1),
            801,
            "CU_EVENT_RECORD_EXTERNAL is refused by name"
        );
        assert_eq!(record(ev, std::ptr::null_mut(), 2), 1, "unknown flag bits");
    }
    println!("CHILD-OK");
}

#[test]
fn emulated_library_kernels_from_a_thread_without_a_context() {
    emulated_child("child_library_kernel_without_context");
}

#[test]
#[ignore = "run in a child process by emulated_library_kernels_from_a_thread_without_a_context"]
fn child_library_kernel_without_context() {
    if std::env::var_os("REMORA_SHIM_CHILD").is_none() {
        return;
    }
    type CtxGetCurrent = unsafe extern "C" fn(*mut *mut c_void) -> c_int;
    type LibraryLoadData = unsafe extern "C" fn(
        *mut *mut c_void,
        *const c_void,
        *mut c_void,
        *mut *mut c_void,
        c_uint,
        *mut c_void,
        *mut *mut c_void,
        c_uint,
    ) -> c_int;
    type LibraryGetKernel = unsafe extern "C" fn(*mut *mut c_void, *mut c_void, *const i8) -> c_int;
    // SAFETY: loading our own shim.
    let lib = unsafe { libloading::Library::new(shim_path()) }.unwrap();
    // SAFETY: every symbol has the signature cuda.h gives it; outputs point to locals; the
    // images are NUL-terminated text.
    unsafe {
        let load: libloading::Symbol<LibraryLoadData> = lib.get(b"cuLibraryLoadData").unwrap();
        init_with_context(&lib);
        let image = c"REMORA-EMU-MODULE\nfunc vecadd 8,8,8,4\n";
        let (mut used, mut unused) = (std::ptr::null_mut(), std::ptr::null_mut());
        let none = std::ptr::null_mut();
        assert_eq!(
            load(
                &mut used,
                image.as_ptr().cast(),
                none,
                &mut std::ptr::null_mut(),
                0,
                none,
                &mut std::ptr::null_mut(),
                0
            ),
            0
        );
        assert_eq!(
            load(
                &mut unused,
                image.as_ptr().cast(),
                none,
                &mut std::ptr::null_mut(),
                0,
                none,
                &mut std::ptr::null_mut(),
                0
            ),
            0
        );
        let get_kernel: libloading::Symbol<LibraryGetKernel> =
            lib.get(b"cuLibraryGetKernel").unwrap();
        let mut k = std::ptr::null_mut();
        assert_eq!(get_kernel(&mut k, used, c"vecadd".as_ptr()), 0);
        let in_main = k as usize;
        let (used, unused) = (used as usize, unused as usize);
        let shim = shim_path();
        // A thread with no current context (as PyTorch's autograd threads are when the CUDA
        // runtime asks for a kernel): cuLibraryGetKernel needs none natively.
        std::thread::spawn(move || {
            // SAFETY: as above; the handles are the shim's, valid in every thread.
            let lib = libloading::Library::new(shim).unwrap();
            let current: libloading::Symbol<CtxGetCurrent> = lib.get(b"cuCtxGetCurrent").unwrap();
            let get_kernel: libloading::Symbol<LibraryGetKernel> =
                lib.get(b"cuLibraryGetKernel").unwrap();
            let mut c = std::ptr::dangling_mut();
            assert_eq!(current(&mut c), 0);
            assert!(c.is_null(), "no context in this thread");
            let mut k = std::ptr::null_mut();
            assert_eq!(
                get_kernel(&mut k, used as *mut c_void, c"vecadd".as_ptr()),
                0
            );
            assert_eq!(
                k as usize, in_main,
                "the same kernel as from the main thread"
            );
            assert_eq!(
                get_kernel(&mut k, unused as *mut c_void, c"vecadd".as_ptr()),
                0
            );
            assert_eq!(
                get_kernel(&mut k, unused as *mut c_void, c"nope".as_ptr()),
                500,
                "CUDA_ERROR_NOT_FOUND"
            );
        })
        .join()
        .unwrap();
    }
    println!("CHILD-OK");
}

#[test]
fn emulated_stream_ordered_allocation() {
    emulated_child("child_stream_ordered_allocation");
}

#[test]
#[ignore = "run in a child process by emulated_stream_ordered_allocation"]
fn child_stream_ordered_allocation() {
    if std::env::var_os("REMORA_SHIM_CHILD").is_none() {
        return;
    }
    use remora_cuda_abi::pools::{MemLocation, MemPoolProps};
    type AllocAsync = unsafe extern "C" fn(*mut u64, usize, *mut c_void) -> c_int;
    type FromPool = unsafe extern "C" fn(*mut u64, usize, *mut c_void, *mut c_void) -> c_int;
    type FreeAsync = unsafe extern "C" fn(u64, *mut c_void) -> c_int;
    type Htod = unsafe extern "C" fn(u64, *const c_void, usize) -> c_int;
    type Dtoh = unsafe extern "C" fn(*mut c_void, u64, usize) -> c_int;
    type DefaultPool = unsafe extern "C" fn(*mut *mut c_void, c_int) -> c_int;
    type Create = unsafe extern "C" fn(*mut *mut c_void, *const MemPoolProps) -> c_int;
    type Destroy = unsafe extern "C" fn(*mut c_void) -> c_int;
    type Attr = unsafe extern "C" fn(*mut c_void, c_int, *mut c_void) -> c_int;
    type Trim = unsafe extern "C" fn(*mut c_void, usize) -> c_int;
    type ExportPointer = unsafe extern "C" fn(*mut c_void, u64) -> c_int;
    // SAFETY: loading our own shim.
    let lib = unsafe { libloading::Library::new(shim_path()) }.unwrap();
    // SAFETY: every symbol has the signature cuda.h gives it; outputs point to locals of the
    // right type.
    unsafe {
        let alloc: libloading::Symbol<AllocAsync> = lib.get(b"cuMemAllocAsync").unwrap();
        let alloc_ptsz: libloading::Symbol<AllocAsync> = lib.get(b"cuMemAllocAsync_ptsz").unwrap();
        let from_pool: libloading::Symbol<FromPool> = lib.get(b"cuMemAllocFromPoolAsync").unwrap();
        let free: libloading::Symbol<FreeAsync> = lib.get(b"cuMemFreeAsync").unwrap();
        let free_ptsz: libloading::Symbol<FreeAsync> = lib.get(b"cuMemFreeAsync_ptsz").unwrap();
        let htod: libloading::Symbol<Htod> = lib.get(b"cuMemcpyHtoD_v2").unwrap();
        let dtoh: libloading::Symbol<Dtoh> = lib.get(b"cuMemcpyDtoH_v2").unwrap();
        let default_pool: libloading::Symbol<DefaultPool> =
            lib.get(b"cuDeviceGetDefaultMemPool").unwrap();
        let create: libloading::Symbol<Create> = lib.get(b"cuMemPoolCreate").unwrap();
        let destroy: libloading::Symbol<Destroy> = lib.get(b"cuMemPoolDestroy").unwrap();
        let get: libloading::Symbol<Attr> = lib.get(b"cuMemPoolGetAttribute").unwrap();
        let set: libloading::Symbol<Attr> = lib.get(b"cuMemPoolSetAttribute").unwrap();
        let trim: libloading::Symbol<Trim> = lib.get(b"cuMemPoolTrimTo").unwrap();
        let export: libloading::Symbol<ExportPointer> = lib.get(b"cuMemPoolExportPointer").unwrap();
        init_with_context(&lib);
        let null = std::ptr::null_mut();
        // cuMemAllocAsync on the legacy stream: copies reach the allocation.
        let mut p = 0u64;
        assert_eq!(alloc(&mut p, 4096, null), 0);
        let data: Vec<u8> = (0..4096u32).map(|i| (i * 7) as u8).collect();
        assert_eq!(htod(p, data.as_ptr().cast(), 4096), 0);
        let mut back = vec![0u8; 4096];
        assert_eq!(dtoh(back.as_mut_ptr().cast(), p, 4096), 0);
        assert_eq!(back, data);
        // The per-thread stream forms.
        let mut q = 0u64;
        assert_eq!(alloc_ptsz(&mut q, 1024, null), 0);
        assert_eq!(free_ptsz(q, null), 0);
        // The default pool counts what is allocated from it.
        let mut dp = null;
        assert_eq!(default_pool(&mut dp, 0), 0);
        let mut used = 0u64;
        assert_eq!(get(dp, 7, (&raw mut used).cast()), 0);
        assert_eq!(used, 4096, "CU_MEMPOOL_ATTR_USED_MEM_CURRENT");
        assert_eq!(destroy(dp), 1, "the default pool cannot be destroyed");
        // A created pool: int and 64-bit attributes, reuse of its cache, trim.
        let props = MemPoolProps {
            alloc_type: 1,
            location: MemLocation { kind: 1, id: 0 },
            ..MemPoolProps::default()
        };
        let mut pool = null;
        assert_eq!(create(&mut pool, &props), 0);
        let mut follow: c_int = -1;
        assert_eq!(get(pool, 1, (&raw mut follow).cast()), 0);
        assert_eq!(follow, 1, "CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES");
        let mut keep = u64::MAX;
        assert_eq!(set(pool, 4, (&raw mut keep).cast()), 0);
        let mut r = 0u64;
        assert_eq!(from_pool(&mut r, 65536, pool, null), 0);
        assert_eq!(free(r, null), 0);
        let mut reserved = 0u64;
        assert_eq!(get(pool, 5, (&raw mut reserved).cast()), 0);
        assert_eq!(reserved, 65536, "kept under the release threshold");
        assert_eq!(trim(pool, 0), 0);
        assert_eq!(get(pool, 5, (&raw mut reserved).cast()), 0);
        assert_eq!(reserved, 0, "trimmed");
        assert_eq!(
            get(pool, 99, (&raw mut reserved).cast()),
            1,
            "unknown attribute"
        );
        assert_eq!(destroy(pool), 0);
        // Not carried: pools with shareable handles, IPC of pool pointers.
        let ipc = MemPoolProps {
            handle_types: 1,
            ..props
        };
        assert_eq!(create(&mut pool, &ipc), 801);
        let mut share = [0u8; 64];
        assert_eq!(export(share.as_mut_ptr().cast(), p), 801);
        assert_eq!(free(p, null), 0);
        assert_eq!(htod(p, data.as_ptr().cast(), 16), 1, "freed");
    }
    println!("CHILD-OK");
}
