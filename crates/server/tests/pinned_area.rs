//! Zero-copy pinned memory (issue 5, item 4): on a session in shared memory,
//! `cuMemHostAlloc` memory lies in the data area, and copies from and to it pass only
//! (offset, size): the client copies nothing, the server reads and writes the area where the
//! bytes are; pinned memory leaves the staging space free; a device address that collides
//! with a client mapping is allocated again. Client `Session` → executor → EMULATED backend.

mod common;

use std::sync::{Arc, Mutex};

use common::*;
use remora_client::PinnedCopy;
use remora_oncrpc::TransportChoice;

/// `n` bytes of host memory at `p` as a slice.
///
/// # Safety
/// `p` must be a live allocation of at least `n` bytes that nothing else uses meanwhile.
unsafe fn host<'a>(p: u64, n: usize) -> &'a mut [u8] {
    // SAFETY: per this function's contract.
    unsafe { std::slice::from_raw_parts_mut(p as usize as *mut u8, n) }
}

const N: usize = 100_000;

#[test]
fn pinned_memory_lies_in_the_area_and_copies_are_zero_copy() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // Room for both buffers beside the staging reserve.
    let server = serve(4 * AREA);
    let s = session(&server.endpoint, TransportChoice::Shm);
    let ctx = s.primary_ctx_retain(0).unwrap();
    let dev = s.mem_alloc(ctx, N as u64).unwrap();
    let free0 = s.area_free_bytes();
    let src = s.host_memory().alloc(N as u64, 0, ctx).unwrap();
    let dst = s.host_memory().alloc(N as u64, 0, ctx).unwrap();
    assert!(s.pinned_offset(src, N as u64).is_some());
    assert!(s.pinned_offset(dst, N as u64).is_some());
    assert!(s.pinned_offset(src + 1, N as u64).is_none(), "past the end");
    assert!(s.area_free_bytes() <= free0 - 2 * N as u64);
    let before = s.area_bytes_copied();

    // Synchronous, both directions, through the slice API (what the shim calls).
    let data = pattern(N, 1);
    // SAFETY: `src` and `dst` are live allocations of N bytes used only by this test.
    let (hs, hd) = unsafe { (host(src, N), host(dst, N)) };
    hs.copy_from_slice(&data);
    s.memcpy_htod(ctx, LEGACY, dev, hs).unwrap();
    s.memcpy_dtoh(ctx, LEGACY, dev, hd).unwrap();
    assert_eq!(hd, &data[..]);

    // Asynchronous, both directions, on a stream; the D2H is never delivered, so nothing
    // is pending on the client, and the bytes are there at the stream's synchronize.
    let stream = s.stream_create(ctx, 0, 0).unwrap();
    let data2 = pattern(N, 2);
    hs.copy_from_slice(&data2);
    hd.fill(0);
    s.memcpy_htod_async(ctx, stream, dev, hs).unwrap();
    s.memcpy_dtoh_pinned(PinnedCopy {
        ctx,
        stream,
        dev,
        host: dst,
        size: N as u64,
        asynchronous: true,
    })
    .unwrap();
    assert_eq!(s.pending_copies(), 0);
    s.stream_synchronize(ctx, stream).unwrap();
    assert_eq!(hd, &data2[..]);

    // Visible at an event's synchronize and at a stream query, too.
    let data3 = pattern(N, 3);
    hs.copy_from_slice(&data3);
    hd.fill(0);
    s.memcpy_htod_pinned(PinnedCopy {
        ctx,
        stream,
        dev,
        host: src,
        size: N as u64,
        asynchronous: true,
    })
    .unwrap();
    s.memcpy_dtoh_pinned(PinnedCopy {
        ctx,
        stream,
        dev,
        host: dst + 10,
        size: (N - 10) as u64,
        asynchronous: true,
    })
    .unwrap();
    let ev = s.event_create(ctx, 0).unwrap();
    s.event_record(ctx, ev, stream).unwrap();
    s.event_synchronize(ev).unwrap();
    assert_eq!(&hd[10..], &data3[..N - 10]);
    assert!(s.stream_query(ctx, stream).unwrap());

    // The client copied nothing into or out of the area.
    assert_eq!(s.area_bytes_copied(), before);

    s.event_destroy(ev).unwrap();
    s.stream_destroy(stream).unwrap();
    s.mem_free_host(src).unwrap();
    s.mem_free_host(dst).unwrap();
    assert_eq!(s.area_free_bytes(), free0, "freeing returns the space");
    assert!(s.mem_free_host(src).is_err(), "freed twice");
    // A pageable copy (through a staging lease, now that there is room) does copy.
    let mut pageable = vec![0u8; N];
    s.memcpy_dtoh(ctx, LEGACY, dev, &mut pageable).unwrap();
    assert_eq!(pageable, data3);
    assert!(s.area_bytes_copied() > before);
    s.mem_free(ctx, dev).unwrap();
}

#[test]
fn freed_pinned_memory_is_refused_not_a_crash() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let server = serve(AREA);
    let s = session(&server.endpoint, TransportChoice::Shm);
    let ctx = s.primary_ctx_retain(0).unwrap();
    let dev = s.mem_alloc(ctx, 4096).unwrap();
    let p = s.host_memory().alloc(4096, 0, ctx).unwrap();
    s.host_memory().free(p).unwrap();
    let invalid = Err(remora_client::CuError(remora_client::cu::INVALID_VALUE));
    for asynchronous in [false, true] {
        let c = PinnedCopy {
            ctx,
            stream: LEGACY,
            dev,
            host: p,
            size: 4096,
            asynchronous,
        };
        assert_eq!(s.memcpy_htod_pinned(c), invalid, "async {asynchronous}");
        assert_eq!(s.memcpy_dtoh_pinned(c), invalid, "async {asynchronous}");
    }
    assert_eq!(s.pending_copies(), 0);
    // The session goes on.
    s.ctx_synchronize(ctx).unwrap();
    s.mem_free(ctx, dev).unwrap();
}

#[test]
fn too_large_for_the_area_falls_back_to_private_memory() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let server = serve(AREA);
    let s = session(&server.endpoint, TransportChoice::Shm);
    let ctx = s.primary_ctx_retain(0).unwrap();
    let n = 2 * AREA as usize;
    let p = s.host_memory().alloc(n as u64, 0, ctx).unwrap();
    assert!(s.pinned_offset(p, 1).is_none());
    let dev = s.mem_alloc(ctx, n as u64).unwrap();
    let data = pattern(n, 4);
    // SAFETY: `p` is a live allocation of n bytes used only by this test.
    let h = unsafe { host(p, n) };
    h.copy_from_slice(&data);
    s.memcpy_htod(ctx, LEGACY, dev, h).unwrap();
    h.fill(0);
    s.memcpy_dtoh(ctx, LEGACY, dev, h).unwrap();
    assert_eq!(h, &data[..]);
    s.host_memory().free(p).unwrap();
    s.mem_free(ctx, dev).unwrap();
}

#[test]
fn unix_sessions_keep_private_host_memory() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let server = serve(AREA);
    let s = session(&server.endpoint, TransportChoice::Unix);
    let ctx = s.primary_ctx_retain(0).unwrap();
    let p = s.host_memory().alloc(N as u64, 0, ctx).unwrap();
    assert!(s.pinned_offset(p, 1).is_none());
    assert!(s.host_memory().find(p).unwrap().area_offset.is_none());
    let dev = s.mem_alloc(ctx, N as u64).unwrap();
    let data = pattern(N, 5);
    // SAFETY: `p` is a live allocation of N bytes used only by this test.
    let h = unsafe { host(p, N) };
    h.copy_from_slice(&data);
    let stream = s.stream_create(ctx, 0, 0).unwrap();
    s.memcpy_htod_async(ctx, stream, dev, h).unwrap();
    let got = Arc::new(Mutex::new(None));
    let sink = Arc::clone(&got);
    s.memcpy_dtoh_async(
        ctx,
        stream,
        dev,
        N as u64,
        Box::new(move |d: &[u8]| *sink.lock().unwrap() = Some(d.to_vec())),
    )
    .unwrap();
    s.stream_synchronize(ctx, stream).unwrap();
    assert_eq!(got.lock().unwrap().take().unwrap(), data);
    assert_eq!(
        s.memcpy_htod_pinned(PinnedCopy {
            ctx,
            stream: LEGACY,
            dev,
            host: p,
            size: N as u64,
            asynchronous: false
        }),
        Err(remora_client::CuError(remora_client::cu::INVALID_VALUE))
    );
    s.stream_destroy(stream).unwrap();
    s.host_memory().free(p).unwrap();
    s.mem_free(ctx, dev).unwrap();
}

#[test]
fn pinned_memory_leaves_staging_room_and_busy_areas_stream_in_smaller_chunks() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let server = serve(AREA);
    let s = session(&server.endpoint, TransportChoice::Shm);
    let ctx = s.primary_ctx_retain(0).unwrap();
    let area = s.data_area_size();
    let reserve = (area / 4).min(32 << 20);
    // Pinned memory takes the area up to the staging reserve, then goes private.
    let big = s.host_memory().alloc(area - reserve, 0, ctx).unwrap();
    assert!(
        s.pinned_offset(big, area - reserve).is_some(),
        "fits beside the reserve"
    );
    let more = s.host_memory().alloc(8192, 0, ctx).unwrap();
    assert!(
        s.pinned_offset(more, 8192).is_none(),
        "would eat the staging reserve: private memory instead"
    );
    // A pageable copy larger than the reserve still streams through the area, in chunks
    // that fit what is left.
    let n = (reserve * 3) as usize;
    let dev = s.mem_alloc(ctx, n as u64).unwrap();
    let data = pattern(n, 9);
    let before = s.area_bytes_copied();
    s.memcpy_htod(ctx, LEGACY, dev, &data).unwrap();
    let mut back = vec![0u8; n];
    s.memcpy_dtoh(ctx, LEGACY, dev, &mut back).unwrap();
    assert!(back == data, "round trip through a nearly full area");
    assert_eq!(
        s.area_bytes_copied() - before,
        2 * n as u64,
        "both ways through the area"
    );
    s.mem_free_host(more).unwrap();
    s.mem_free_host(big).unwrap();
    s.mem_free(ctx, dev).unwrap();
}

/// The server's driver picks device addresses; when one lands on a mapping of the client
/// process, `cuMemAlloc` keeps it aside, asks again and frees the collided one, instead of
/// failing with CUDA_ERROR_OUT_OF_MEMORY.
#[test]
fn a_device_address_colliding_with_a_host_mapping_is_allocated_again() {
    use rustix::mm::{MapFlags, ProtFlags, mmap_anonymous, munmap};
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let server = serve(0);
    let s = session(&server.endpoint, TransportChoice::Unix);
    let ctx = s.primary_ctx_retain(0).unwrap();
    // The emulated backend hands out addresses in order, a page apart: the next one is
    // predictable. Map a page of our own there.
    let first = s.mem_alloc(ctx, 4096).unwrap();
    let next = first + 8192;
    // SAFETY: a fresh anonymous page at an address nothing of ours uses (NOREPLACE fails
    // rather than replacing a mapping).
    let page = unsafe {
        mmap_anonymous(
            next as usize as *mut std::ffi::c_void,
            4096,
            ProtFlags::READ,
            MapFlags::PRIVATE | MapFlags::FIXED_NOREPLACE,
        )
    };
    let Ok(page) = page else {
        println!("SKIPPED: cannot map a page at {next:#x} in this process");
        return;
    };
    let second = s.mem_alloc(ctx, 4096).unwrap();
    assert_ne!(
        second, next,
        "the colliding address was not handed to the program"
    );
    assert_eq!(
        second,
        next + 8192,
        "the next address after the collided one"
    );
    // The collided allocation was freed on the server: its address is not in use.
    assert!(s.mem_free(ctx, next).is_err());
    s.mem_free(ctx, second).unwrap();
    s.mem_free(ctx, first).unwrap();
    // SAFETY: the page mapped above, used by nothing.
    unsafe { munmap(page, 4096) }.unwrap();
}

/// `remora serve --shm-lock-max`: sessions page-lock their data areas (the CUDA backend
/// registers them for DMA) only while the server-wide budget has room; the budget comes back
/// when a session ends. (The emulated backend locks nothing; the executor's accounting is
/// what is checked.)
#[test]
fn page_locked_areas_stay_within_the_servers_budget() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let server = serve_with(remora_server::ShmConfig {
        enabled: true,
        data_bytes: AREA,
        lock_max_bytes: AREA * 3 / 2,
    });
    let endpoint = server.endpoint.clone();
    let executor = server.executor();
    assert_eq!(executor.area_lock_budget(), AREA * 3 / 2);
    let first = session(&endpoint, TransportChoice::Shm);
    first.primary_ctx_retain(0).unwrap();
    assert_eq!(
        executor.area_lock_budget(),
        AREA / 2,
        "the first area is locked"
    );
    let second = session(&endpoint, TransportChoice::Shm);
    second.primary_ctx_retain(0).unwrap();
    assert_eq!(
        executor.area_lock_budget(),
        AREA / 2,
        "no room for the second"
    );
    // The second session still works, through staging buffers.
    let ctx = second.primary_ctx_retain(0).unwrap();
    let dev = second.mem_alloc(ctx, 1000).unwrap();
    second
        .memcpy_htod(ctx, LEGACY, dev, &pattern(1000, 5))
        .unwrap();
    let mut back = vec![0u8; 1000];
    second.memcpy_dtoh(ctx, LEGACY, dev, &mut back).unwrap();
    assert_eq!(back, pattern(1000, 5));
    drop(first);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while executor.area_lock_budget() != AREA * 3 / 2 {
        assert!(std::time::Instant::now() < deadline, "the budget came back");
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// Mapped host memory (`cuMemHostGetDevicePointer`, revision 9): memory in the data area has
/// a device address, one linear mapping of the area; registered memory elsewhere gets a
/// device copy; private memory (what `HostMem` itself allocates on a socket session, as
/// against a server older than revision 10) is refused with CUDA_ERROR_NOT_SUPPORTED.
#[test]
fn area_memory_is_mapped_for_the_device_and_other_memory_is_refused() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let server = serve(4 * AREA);
    let s = session(&server.endpoint, TransportChoice::Shm);
    let ctx = s.primary_ctx_retain(0).unwrap();
    let a = s.host_memory().alloc(N as u64, 2, ctx).unwrap(); // DEVICEMAP
    let b = s.host_memory().alloc(N as u64, 0, ctx).unwrap();
    let da = s.mem_host_device_pointer(ctx, a).unwrap();
    let db = s.mem_host_device_pointer(ctx, b + 100).unwrap();
    assert_ne!(da, 0);
    assert_eq!(
        db.wrapping_sub(da),
        b + 100 - a,
        "one linear mapping of the area"
    );
    // In this test the server runs in the client's process, so the area cannot lie at the
    // same address on both sides: the device address is the server's (emulated backend:
    // its host address), not the client's pointer.
    assert_ne!(da, a);
    // Memory outside the area (registered by the program) gets a device copy elsewhere
    // (managed.rs tests it with kernels).
    let mut private = vec![0u8; 8192];
    let p = private.as_mut_ptr() as u64;
    s.host_memory().register(p, 8192, 2, ctx).unwrap();
    let dp = s.mem_host_device_pointer(ctx, p).unwrap();
    assert!(dp != p && dp != 0);
    assert!(matches!(
        s.pointer_kind(dp),
        remora_client::PointerKind::Device { .. }
    ));
    assert_eq!(
        s.mem_host_device_pointer(ctx, 0x1000),
        Err(remora_client::CuError(remora_client::cu::INVALID_VALUE)),
        "not host memory of this session"
    );
    s.host_memory().unregister(p).unwrap();
    s.mem_free_host(a).unwrap();
    s.mem_free_host(b).unwrap();

    // A socket session has no area: memory from HostMem itself is private and cannot be
    // mapped (Session::mem_host_alloc reserves device addresses instead: managed.rs).
    let u = session(&server.endpoint, TransportChoice::Unix);
    let uctx = u.primary_ctx_retain(0).unwrap();
    let h = u.host_memory().alloc(4096, 2, uctx).unwrap();
    assert_eq!(
        u.mem_host_device_pointer(uctx, h),
        Err(remora_client::CuError(remora_client::cu::NOT_SUPPORTED))
    );
    u.mem_free_host(h).unwrap();
}

/// Revision 18: `cuMemHostAlloc` in the data area has the server page-lock and map the
/// allocation at once (`RM_AREA_MAP`), as the driver does natively, so that a kernel may use
/// its host pointer with no query first (area_copies.rs tests the procedure's refusals).
#[test]
fn allocations_in_the_area_are_mapped_when_made() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let server = serve(4 * AREA);
    let s = session(&server.endpoint, TransportChoice::Shm);
    let ctx = s.primary_ctx_retain(0).unwrap();
    let a = s.mem_host_alloc(ctx, N as u64, 0).unwrap();
    let r = s.host_memory().find(a).unwrap();
    assert!(r.area_offset.is_some(), "in the data area");
    assert!(r.area_mapped, "mapped when allocated");
    // Memory the session holds in the area without cuMemHostAlloc is mapped on its first
    // query, and one linear mapping serves both.
    let b = s.host_memory().alloc(N as u64, 0, ctx).unwrap();
    assert!(!s.host_memory().find(b).unwrap().area_mapped);
    let da = s.mem_host_device_pointer(ctx, a).unwrap();
    let db = s.mem_host_device_pointer(ctx, b).unwrap();
    assert!(s.host_memory().find(b).unwrap().area_mapped);
    assert_eq!(db.wrapping_sub(da), b - a);
    s.mem_free_host(a).unwrap();
    s.mem_free_host(b).unwrap();
}
