//! Managed memory (`cuMemAllocManaged`): one address for host and device, made coherent at
//! launches and synchronizations (CUDA's model without concurrent managed access). Client
//! `Session` → executor → EMULATED backend, over a Unix socket, shared memory and TCP; every
//! byte is checked.

mod common;

use std::ffi::c_void;
use std::sync::Arc;

use common::*;
use remora_client::host::DeviceView;
use remora_client::proto::RmMemsetArgs;
use remora_client::{
    CuError, FunctionInfo, KernelArgs, LaunchConfig, PointerKind, Session, StreamRef, cu,
};
use remora_oncrpc::TransportChoice;

const N: usize = 3000; // floats: 12,000 bytes, three pages less a bit

fn vecadd(s: &Session, ctx: u64) -> Arc<FunctionInfo> {
    let m = s
        .module_load(ctx, b"REMORA-EMU-MODULE\nfunc vecadd 8,8,8,4\n")
        .unwrap();
    Arc::clone(&m.functions["vecadd"])
}

/// `c = a + b` over `n` floats, on `stream`.
fn add(s: &Session, ctx: u64, f: &FunctionInfo, (a, b, c): (u64, u64, u64), stream: StreamRef) {
    let n = N as i32;
    let args: [*const c_void; 4] = [
        (&a as *const u64).cast(),
        (&b as *const u64).cast(),
        (&c as *const u64).cast(),
        (&n as *const i32).cast(),
    ];
    let config = LaunchConfig {
        grid: [N.div_ceil(256) as u32, 1, 1],
        block: [256, 1, 1],
        shared_mem_bytes: 0,
        stream,
        attrs: Vec::new(),
    };
    // SAFETY: one valid pointer per parameter of vecadd(float*, float*, float*, int).
    unsafe { s.launch_kernel(ctx, f, &config, KernelArgs::Params(args.as_ptr())) }.unwrap();
}

/// The host view of `n` floats of managed memory at `p`.
fn floats<'a>(p: u64) -> &'a mut [f32] {
    // SAFETY: `p` is a live managed allocation of at least N floats, mapped read-write in
    // this process; the tests touch it only while no kernel runs.
    unsafe { std::slice::from_raw_parts_mut(p as usize as *mut f32, N) }
}

fn transports(server: &Server) -> Vec<(remora_oncrpc::Endpoint, TransportChoice)> {
    vec![
        (server.endpoint.clone(), TransportChoice::Unix),
        (server.endpoint.clone(), TransportChoice::Shm),
        (server.tcp(), TransportChoice::Auto),
    ]
}

/// Runs `body` once per transport, each with a fresh session, its primary context and the
/// vecadd test kernel, one test at a time.
fn per_transport(body: impl Fn(&Session, u64, &FunctionInfo, TransportChoice)) {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let server = serve(4 * AREA);
    for (endpoint, transport) in transports(&server) {
        let s = session(&endpoint, transport);
        let ctx = s.primary_ctx_retain(0).unwrap();
        let f = vecadd(&s, ctx);
        body(&s, ctx, &f, transport);
    }
}

#[test]
fn host_writes_reach_kernels_and_kernel_writes_reach_the_host() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let server = serve(4 * AREA);
    for (endpoint, transport) in transports(&server) {
        let s = session(&endpoint, transport);
        let ctx = s.primary_ctx_retain(0).unwrap();
        let f = vecadd(&s, ctx);
        let bytes = (N * 4) as u64;
        let [a, b, c] = [0; 3].map(|_| s.mem_alloc_managed(ctx, bytes, 1).unwrap());
        assert!(
            floats(c).iter().all(|&x| x == 0.0),
            "managed memory starts zeroed"
        );
        assert_eq!(s.managed_range(a + 5), Some((a, bytes)));
        assert!(
            matches!(s.pointer_kind(b + 8), PointerKind::Device { base, size, .. } if base == b && size == bytes)
        );

        // Rounds of host writes -> kernel -> synchronize -> host reads, each round through
        // another completion point.
        let stream = s.stream_create(ctx, 1, 0).unwrap();
        for round in 0..4u32 {
            for (i, (x, y)) in floats(a).iter_mut().zip(floats(b).iter_mut()).enumerate() {
                *x = (i as u32 * 3 + round) as f32;
                *y = (round * 1000) as f32 - i as f32;
            }
            let on = if round % 2 == 0 {
                StreamRef::Legacy
            } else {
                StreamRef::Handle(stream)
            };
            add(&s, ctx, &f, (a, b, c), on);
            match round {
                0 => s.ctx_synchronize(ctx).unwrap(),
                1 => s.stream_synchronize(ctx, stream).unwrap(),
                2 => {
                    let e = s.event_create(ctx, 0).unwrap();
                    s.event_record(ctx, e, LEGACY).unwrap();
                    s.event_synchronize(e).unwrap();
                    s.event_destroy(e).unwrap();
                }
                _ => while !s.stream_query(ctx, stream).unwrap() {},
            }
            for (i, &z) in floats(c).iter().enumerate() {
                let want = (i as u32 * 3 + round) as f32 + ((round * 1000) as f32 - i as f32);
                assert_eq!(z, want, "round {round}, element {i} over {transport:?}");
            }
        }

        // Host writes reach copies too; a synchronous copy into managed memory is visible at
        // once.
        floats(a)[1234] = 42.5;
        let plain = s.mem_alloc(ctx, bytes).unwrap();
        s.memcpy_dtod(ctx, LEGACY, plain, a, bytes).unwrap();
        let mut out = vec![0u8; bytes as usize];
        s.memcpy_dtoh(ctx, LEGACY, plain, &mut out).unwrap();
        assert_eq!(&out[1234 * 4..1235 * 4], &42.5f32.to_le_bytes());
        s.memset(&RmMemsetArgs {
            ctx,
            stream: LEGACY,
            dst: c + 8,
            value: 0x3f80_0000, // 1.0f32
            element_size: 4,
            count: 10,
        })
        .unwrap();
        assert!(floats(c)[2..12].iter().all(|&x| x == 1.0));
        assert_ne!(floats(c)[12], 1.0);

        // Hints check their range; freeing forgets the allocation.
        assert_eq!(s.managed_hint(a, bytes), Ok(()));
        assert_eq!(
            s.managed_hint(a, bytes + 1),
            Err(CuError(cu::INVALID_VALUE))
        );
        assert_eq!(s.managed_hint(plain, 4), Err(CuError(cu::INVALID_VALUE)));
        assert_eq!(s.stream_attach_mem(a, 0, 2), Ok(()));
        for p in [a, b, c, plain] {
            s.mem_free(ctx, p).unwrap();
        }
        assert_eq!(s.managed_range(a), None);
        assert!(matches!(s.pointer_kind(a), PointerKind::Host));
        s.stream_destroy(stream).unwrap();
    }
}

#[test]
fn host_changes_during_device_work_are_kept_not_lost() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let server = serve(4 * AREA);
    let s = session(&server.endpoint, TransportChoice::Unix);
    let ctx = s.primary_ctx_retain(0).unwrap();
    let bytes = 3 * 4096;
    let m = s.mem_alloc_managed(ctx, bytes, 1).unwrap();
    // The device writes page 0 and 1; the host (against CUDA's rules) changes page 2 before
    // synchronizing: the pull keeps the host's page 2 and takes the device's pages 0 and 1.
    s.memset_async(&RmMemsetArgs {
        ctx,
        stream: LEGACY,
        dst: m,
        value: 7,
        element_size: 1,
        count: 8192,
    })
    .unwrap();
    // SAFETY: `m` is a live managed allocation of `bytes` bytes, mapped in this process.
    let host = unsafe { std::slice::from_raw_parts_mut(m as usize as *mut u8, bytes as usize) };
    host[8192] = 9;
    s.ctx_synchronize(ctx).unwrap();
    assert!(host[..8192].iter().all(|&x| x == 7));
    assert_eq!(host[8192], 9);
    // ... and page 2 reaches the device before the next copy.
    let mut out = vec![0u8; bytes as usize];
    let plain = s.mem_alloc(ctx, bytes).unwrap();
    s.memcpy_dtod(ctx, LEGACY, plain, m, bytes).unwrap();
    s.memcpy_dtoh(ctx, LEGACY, plain, &mut out).unwrap();
    assert_eq!(out, host);
}

#[test]
fn bad_arguments_and_context_destruction() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let server = serve(0);
    let s = session(&server.endpoint, TransportChoice::Unix);
    let dev_ctx = s.ctx_create(0, 0).unwrap();
    assert_eq!(
        s.mem_alloc_managed(dev_ctx, 0, 1),
        Err(CuError(cu::INVALID_VALUE))
    );
    assert_eq!(
        s.mem_alloc_managed(dev_ctx, 64, 4),
        Err(CuError(cu::INVALID_VALUE))
    );
    assert_eq!(
        s.mem_alloc_managed(dev_ctx, 64, 3),
        Err(CuError(cu::INVALID_VALUE))
    );
    let m = s.mem_alloc_managed(dev_ctx, 64, 2).unwrap();
    assert!(s.managed_range(m).is_some());
    s.ctx_destroy(dev_ctx).unwrap();
    assert_eq!(
        s.managed_range(m),
        None,
        "a destroyed context's managed memory is freed"
    );
}

/// The graphMemoryNodes sample's pattern: with managed memory alive, an asynchronous
/// device-to-host copy on a second stream completes during a synchronize of the first. That
/// synchronize's reply carries the copy's bytes; the managed-memory pull runs before the
/// reply is processed, so it must not wait for that copy (it did: every such synchronize hung
/// for the 60 s delivery limit).
#[test]
fn a_copy_carried_by_the_synchronize_reply_does_not_stall_the_pull() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let server = serve(4 * AREA);
    // Non-blocking streams, and blocking ones (whose copies the legacy stream, on which the
    // pull reads managed memory back, waits for).
    for ((endpoint, transport), flags) in transports(&server)
        .into_iter()
        .flat_map(|t| [(t.clone(), 1), (t, 0)])
    {
        let s = session(&endpoint, transport);
        let ctx = s.primary_ctx_retain(0).unwrap();
        let m = s.mem_alloc_managed(ctx, 4096, 1).unwrap();
        let bytes = 64 * 1024;
        let src: Vec<u8> = (0..bytes).map(|i| (i * 7 + 3) as u8).collect();
        let d = s.mem_alloc(ctx, bytes as u64).unwrap();
        s.memcpy_htod(ctx, LEGACY, d, &src).unwrap();
        let (s1, s2) = (
            s.stream_create(ctx, flags, 0).unwrap(),
            s.stream_create(ctx, flags, 0).unwrap(),
        );
        let got = Arc::new(std::sync::Mutex::new(Vec::new()));
        let sink_got = Arc::clone(&got);
        s.memcpy_dtoh_async(
            ctx,
            s2,
            d,
            bytes as u64,
            Box::new(move |data: &[u8]| sink_got.lock().unwrap().extend_from_slice(data)),
        )
        .unwrap();
        let e = s.event_create(ctx, 0).unwrap();
        s.event_record(ctx, e, s2).unwrap();
        s.stream_wait_event(ctx, s1, e, 0).unwrap();
        floats(m)[0] = 5.0;
        let start = std::time::Instant::now();
        s.stream_synchronize(ctx, s1).unwrap();
        assert!(
            start.elapsed() < std::time::Duration::from_secs(10),
            "synchronize took {:?} over {transport:?}, stream flags {flags}",
            start.elapsed()
        );
        assert_eq!(*got.lock().unwrap(), src, "copy bytes over {transport:?}");
        assert_eq!(floats(m)[0], 5.0);
        s.event_destroy(e).unwrap();
        for st in [s1, s2] {
            s.stream_destroy(st).unwrap();
        }
        s.mem_free(ctx, d).unwrap();
        s.mem_free(ctx, m).unwrap();
    }
}

/// Mapped host memory (`cuMemHostAlloc` with `CU_MEMHOSTALLOC_DEVICEMAP`): over shared memory
/// it lies in the data area; over sockets it is mirrored like managed memory, at one address
/// for host and device. Kernels read what the host wrote before the launch and the host reads
/// what they wrote after a synchronization, through the device pointer.
#[test]
fn mapped_host_memory_over_every_transport() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let server = serve(4 * AREA);
    for (endpoint, transport) in transports(&server) {
        let s = session(&endpoint, transport);
        let ctx = s.primary_ctx_retain(0).unwrap();
        let f = vecadd(&s, ctx);
        let bytes = (N * 4) as u64;
        let [a, b, c] = [0; 3].map(|_| s.mem_host_alloc(ctx, bytes, 2).unwrap());
        let dev = [a, b, c].map(|p| s.mem_host_device_pointer(ctx, p).unwrap());
        let sockets = transport != TransportChoice::Shm;
        if !sockets {
            // In the data area: zero-copy, mapped by the server (the emulated backend's
            // kernels cannot reach the area; the GPU suite runs this over shm).
            assert!(dev.iter().all(|&d| d != 0));
            for p in [a, b, c] {
                s.mem_free_host(p).unwrap();
            }
            continue;
        }
        assert_eq!(
            dev,
            [a, b, c],
            "one address on both sides over {transport:?}"
        );
        assert!(
            matches!(s.pointer_kind(a + 4), PointerKind::HostTracked(r) if r.base == a),
            "host memory to the program over {transport:?}"
        );
        assert_eq!(s.managed_range(a), None, "not managed memory");
        for round in 0..3u32 {
            for (i, (x, y)) in floats(a).iter_mut().zip(floats(b).iter_mut()).enumerate() {
                *x = (i as u32 + round) as f32;
                *y = (round * 100) as f32;
            }
            add(&s, ctx, &f, (dev[0], dev[1], dev[2]), StreamRef::Legacy);
            s.ctx_synchronize(ctx).unwrap();
            for (i, &z) in floats(c).iter().enumerate() {
                assert_eq!(
                    z,
                    (i as u32 + round) as f32 + (round * 100) as f32,
                    "round {round}, element {i} over {transport:?}"
                );
            }
        }
        // A copy into mapped memory lands in the host view and reaches the device too.
        let plain = s.mem_alloc(ctx, bytes).unwrap();
        let ones = vec![0x11u8; bytes as usize];
        s.memcpy_htod(ctx, LEGACY, plain, &ones).unwrap();
        // SAFETY: `a` is a live host allocation of `bytes` bytes.
        let host_a =
            unsafe { std::slice::from_raw_parts_mut(a as usize as *mut u8, bytes as usize) };
        s.memcpy_dtoh(ctx, LEGACY, plain, host_a).unwrap();
        s.memcpy_dtod(ctx, LEGACY, plain, dev[0], bytes).unwrap();
        let mut out = vec![0u8; bytes as usize];
        s.memcpy_dtoh(ctx, LEGACY, plain, &mut out).unwrap();
        assert_eq!(out, ones, "over {transport:?}");
        assert_eq!(
            s.mem_free(ctx, a),
            Err(CuError(cu::INVALID_VALUE)),
            "cuMemFree of host memory"
        );
        for p in [a, b, c] {
            s.mem_free_host(p).unwrap();
        }
        assert!(matches!(s.pointer_kind(a), PointerKind::Host));
        s.mem_free(ctx, plain).unwrap();
    }
}

/// A registered range of `N` floats (heap memory of the test), and its host view.
fn registered(s: &Session, ctx: u64) -> (Vec<f32>, u64) {
    let v = vec![0f32; N];
    let p = v.as_ptr() as u64;
    s.host_memory().register(p, (N * 4) as u64, 0, ctx).unwrap();
    (v, p)
}

#[test]
fn page_locked_memory_is_mapped_on_first_device_pointer() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let server = serve(4 * AREA);
    for (endpoint, transport) in transports(&server) {
        let s = session(&endpoint, transport);
        let ctx = s.primary_ctx_retain(0).unwrap();
        let f = vecadd(&s, ctx);
        let bytes = (N * 4) as u64;
        let sockets = transport != TransportChoice::Shm;
        // Registered memory (outside any data area on every transport) gets a device copy
        // at another address when a device pointer is asked for.
        let (mut rv, r) = registered(&s, ctx);
        let (wv, w) = registered(&s, ctx);
        for (i, x) in rv.iter_mut().enumerate() {
            *x = i as f32;
        }
        let [dr, dw] = [r, w].map(|p| s.mem_host_device_pointer(ctx, p).unwrap());
        assert!(dr != r && dw != w, "registered ranges are copied elsewhere");
        assert_eq!(s.mem_host_device_pointer(ctx, r + 8).unwrap(), dr + 8);
        assert!(matches!(s.pointer_kind(dr), PointerKind::Device { .. }));
        assert!(matches!(s.pointer_kind(r), PointerKind::HostTracked(h) if h.registered));
        for round in 0..2u32 {
            add(&s, ctx, &f, (dr, dr, dw), StreamRef::Legacy);
            s.ctx_synchronize(ctx).unwrap();
            for (i, &z) in wv.iter().enumerate() {
                assert_eq!(
                    z,
                    2.0 * (i as u32 + round) as f32,
                    "round {round}, {i}, {transport:?}"
                );
            }
            // A host write reaches the next launch.
            for x in rv.iter_mut() {
                *x += 1.0;
            }
        }
        for p in [r, w] {
            s.mem_host_unregister(p).unwrap();
        }
        assert!(
            matches!(s.pointer_kind(dr), PointerKind::Host),
            "device copy freed"
        );
        drop((rv, wv));
        if !sockets {
            // cudaMallocHost memory lies in the data area (zero-copy; the emulated backend's
            // kernels cannot reach it, the GPU suite runs it).
            continue;
        }
        // cudaMallocHost memory: its address is reserved on the device, and no device copy
        // exists until a device pointer is asked for.
        let [a, c] = [0; 2].map(|_| s.mem_host_alloc(ctx, bytes, 0).unwrap());
        let view = |p| s.host_memory().find(p).unwrap().view;
        assert!(
            matches!(view(a), DeviceView::Reserved { .. }),
            "{transport:?}"
        );
        assert!(matches!(s.pointer_kind(a + 4), PointerKind::HostTracked(h) if h.base == a));
        assert_eq!(s.mem_host_device_address(ctx, a).unwrap(), a);
        assert!(
            matches!(view(a), DeviceView::Reserved { .. }),
            "an attribute maps nothing"
        );
        // Used for copies only, it is ordinary host memory.
        let plain = s.mem_alloc(ctx, bytes).unwrap();
        for (i, x) in floats(a).iter_mut().enumerate() {
            *x = (3 * i) as f32;
        }
        s.memcpy_htod(ctx, LEGACY, plain, &bytes_of(a, bytes))
            .unwrap();
        s.memcpy_dtoh(ctx, LEGACY, plain, bytes_of_mut(c, bytes))
            .unwrap();
        assert!(
            floats(c)
                .iter()
                .enumerate()
                .all(|(i, &x)| x == (3 * i) as f32)
        );
        // Mapped on demand, at the same address; the host's bytes go with it.
        let [da, dc] = [a, c].map(|p| s.mem_host_device_pointer(ctx, p).unwrap());
        assert_eq!(
            (da, dc),
            (a, c),
            "one address on both sides over {transport:?}"
        );
        assert_eq!(view(a), DeviceView::Mirrored { dev: a });
        add(&s, ctx, &f, (a, c, c), StreamRef::Legacy);
        s.ctx_synchronize(ctx).unwrap();
        assert!(
            floats(c)
                .iter()
                .enumerate()
                .all(|(i, &x)| x == (6 * i) as f32),
            "{transport:?}"
        );
        // Two 32-bit parameters that together look like a pointer into page-locked memory
        // map nothing (only pointer-sized parameters count).
        let g = s.mem_host_alloc(ctx, bytes, 0).unwrap();
        let m = s
            .module_load(ctx, b"REMORA-EMU-MODULE\nfunc halves 4,4\n")
            .unwrap();
        let halves = s.module_get_function(m.handle, "halves").unwrap();
        let word = (g + 16).to_ne_bytes();
        let lo = u32::from_ne_bytes([word[0], word[1], word[2], word[3]]);
        let hi = u32::from_ne_bytes([word[4], word[5], word[6], word[7]]);
        let args: [*const c_void; 2] = [(&lo as *const u32).cast(), (&hi as *const u32).cast()];
        let config = LaunchConfig {
            grid: [1, 1, 1],
            block: [1, 1, 1],
            shared_mem_bytes: 0,
            stream: StreamRef::Legacy,
            attrs: Vec::new(),
        };
        // SAFETY: one valid pointer per parameter of halves(unsigned, unsigned). The emulated
        // backend has no such kernel: the launch fails on the server, after the client's scan.
        let _ =
            unsafe { s.launch_kernel(ctx, &halves, &config, KernelArgs::Params(args.as_ptr())) };
        let _ = s.ctx_synchronize(ctx);
        assert!(
            matches!(view(g), DeviceView::Reserved { .. }),
            "a pair of 32-bit parameters mirrored page-locked memory over {transport:?}"
        );
        // Unified addressing: a host pointer handed to a kernel directly maps its allocation.
        let e = s.mem_host_alloc(ctx, bytes, 0).unwrap();
        for (i, x) in floats(e).iter_mut().enumerate() {
            *x = i as f32;
        }
        add(&s, ctx, &f, (e, e, e), StreamRef::Legacy);
        s.ctx_synchronize(ctx).unwrap();
        assert_eq!(view(e), DeviceView::Mirrored { dev: e });
        assert!(
            floats(e)
                .iter()
                .enumerate()
                .all(|(i, &x)| x == (2 * i) as f32),
            "{transport:?}"
        );
        for p in [a, c, e] {
            s.mem_free_host(p).unwrap();
            assert!(matches!(s.pointer_kind(p), PointerKind::Host));
        }
        s.mem_free(ctx, plain).unwrap();
    }
}

fn bytes_of(p: u64, n: u64) -> Vec<u8> {
    // SAFETY: `p` is a live host allocation of at least `n` bytes.
    unsafe { std::slice::from_raw_parts(p as usize as *const u8, n as usize) }.to_vec()
}

fn bytes_of_mut<'a>(p: u64, n: u64) -> &'a mut [u8] {
    // SAFETY: `p` is a live host allocation of at least `n` bytes that nothing else uses now.
    unsafe { std::slice::from_raw_parts_mut(p as usize as *mut u8, n as usize) }
}

/// A host function sees what device work before it on its stream wrote to managed memory
/// (read back on that stream before the function runs), and what it writes reaches later
/// kernels.
#[test]
fn host_functions_see_managed_memory_written_before_them() {
    per_transport(|s, ctx, f, transport| {
        let bytes = (N * 4) as u64;
        let [a, c] = [0; 2].map(|_| s.mem_alloc_managed(ctx, bytes, 1).unwrap());
        for (i, x) in floats(a).iter_mut().enumerate() {
            *x = i as f32;
        }
        let st = s.stream_create(ctx, 0, 0).unwrap();
        add(s, ctx, f, (a, a, c), StreamRef::Handle(st));
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen_cb = Arc::clone(&seen);
        s.launch_host_func(
            ctx,
            st,
            Box::new(move |_| {
                let c = floats(c);
                seen_cb.lock().unwrap().extend_from_slice(c);
                // The function changes managed memory; the next kernel reads the change.
                c[0] = 1000.0;
            }),
        )
        .unwrap();
        s.stream_synchronize(ctx, st).unwrap();
        let seen = seen.lock().unwrap().clone();
        assert_eq!(seen.len(), N);
        for (i, &z) in seen.iter().enumerate() {
            assert_eq!(
                z,
                (2 * i) as f32,
                "element {i} in the host function over {transport:?}"
            );
        }
        add(s, ctx, f, (c, c, a), StreamRef::Handle(st));
        s.stream_synchronize(ctx, st).unwrap();
        assert_eq!(floats(a)[0], 2000.0, "over {transport:?}");
        assert_eq!(floats(a)[5], 20.0, "over {transport:?}");
        s.stream_destroy(st).unwrap();
        for p in [a, c] {
            s.mem_free(ctx, p).unwrap();
        }
    });
}

/// What a host function writes to managed memory reaches device work enqueued after it on
/// its stream even when that work is submitted before the function runs (the function sleeps
/// first): the submission waits for the function and pushes its change. A pull afterwards
/// keeps the change without calling it a conflict.
#[test]
fn host_function_writes_reach_work_enqueued_before_it_ran() {
    per_transport(|s, ctx, f, transport| {
        let bytes = (N * 4) as u64;
        let [a, c] = [0; 2].map(|_| s.mem_alloc_managed(ctx, bytes, 1).unwrap());
        for (i, x) in floats(c).iter_mut().enumerate() {
            *x = i as f32;
        }
        let st = s.stream_create(ctx, 0, 0).unwrap();
        for round in 1..=3 {
            let value = 1000.0 * round as f32;
            s.launch_host_func(
                ctx,
                st,
                Box::new(move |_| {
                    std::thread::sleep(std::time::Duration::from_millis(150));
                    floats(c)[0] = value;
                }),
            )
            .unwrap();
            // Submitted at once; the function has not run yet.
            add(s, ctx, f, (c, c, a), StreamRef::Handle(st));
            s.stream_synchronize(ctx, st).unwrap();
            assert_eq!(
                floats(a)[0],
                2.0 * value,
                "round {round} over {transport:?}"
            );
            assert_eq!(floats(a)[7], 14.0, "round {round} over {transport:?}");
            assert_eq!(floats(c)[0], value, "round {round} over {transport:?}");
        }
        // A host function whose change no device work reads before the synchronize: kept.
        s.launch_host_func(ctx, st, Box::new(move |_| floats(c)[1] = -1.0))
            .unwrap();
        s.stream_synchronize(ctx, st).unwrap();
        assert_eq!(floats(c)[1], -1.0, "over {transport:?}");
        add(s, ctx, f, (c, c, a), StreamRef::Handle(st));
        s.stream_synchronize(ctx, st).unwrap();
        assert_eq!(floats(a)[1], -2.0, "over {transport:?}");
        s.stream_destroy(st).unwrap();
        for p in [a, c] {
            s.mem_free(ctx, p).unwrap();
        }
    });
}

/// A graph host node's writes to managed memory reach device work submitted after the graph
/// launch, even before the graph has run (the node sleeps first).
#[test]
fn graph_host_node_writes_reach_work_after_the_launch() {
    per_transport(|s, ctx, f, transport| {
        let bytes = (N * 4) as u64;
        let [a, c] = [0; 2].map(|_| s.mem_alloc_managed(ctx, bytes, 1).unwrap());
        for (i, x) in floats(c).iter_mut().enumerate() {
            *x = i as f32;
        }
        let g = s.graph_create(ctx, 0).unwrap();
        let runs = Arc::new(std::sync::atomic::AtomicU32::new(0));
        let runs_cb = Arc::clone(&runs);
        s.graph_add_host_node(
            g,
            &[],
            Arc::new(move || {
                std::thread::sleep(std::time::Duration::from_millis(150));
                let n = runs_cb.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
                floats(c)[0] = 1000.0 * n as f32;
            }),
        )
        .unwrap();
        let exec = s.graph_instantiate(ctx, g, 0).unwrap();
        let st = s.stream_create(ctx, 0, 0).unwrap();
        for round in 1..=2u32 {
            s.graph_launch(ctx, exec, st).unwrap();
            add(s, ctx, f, (c, c, a), StreamRef::Handle(st));
            s.stream_synchronize(ctx, st).unwrap();
            assert_eq!(
                floats(a)[0],
                2000.0 * round as f32,
                "round {round} over {transport:?}"
            );
            assert_eq!(floats(a)[3], 6.0, "round {round} over {transport:?}");
        }
        s.graph_exec_destroy(exec).unwrap();
        s.graph_destroy(g).unwrap();
        s.stream_destroy(st).unwrap();
        for p in [a, c] {
            s.mem_free(ctx, p).unwrap();
        }
    });
}
