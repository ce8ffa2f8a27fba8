//! Virtual memory management (revision 10): physical allocations, reserved ranges, mappings,
//! access, handles retained by address; isolation between sessions and cleanup at the end of
//! a session. Client `Session` → executor → EMULATED backend (2 MiB granularity; an access
//! before `cuMemSetAccess` fails, as a kernel's would fault on the GPU).

mod common;

use std::time::{Duration, Instant};

use common::*;
use remora_client::proto::{RmMemAccess, RmMemProp};
use remora_client::{CuError, PointerKind, Session, cu};
use remora_oncrpc::TransportChoice;
use remora_server::LiveCounts;

const G: u64 = 2 << 20;

fn device_prop() -> RmMemProp {
    RmMemProp {
        r#type: 1,        // CU_MEM_ALLOCATION_TYPE_PINNED
        handle_types: 1,  // CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, as PyTorch asks
        location_type: 1, // CU_MEM_LOCATION_TYPE_DEVICE
        location_id: 0,
        compression_type: 0,
        rdma_capable: 0,
        usage: 0,
    }
}

fn read_write() -> Vec<RmMemAccess> {
    vec![RmMemAccess {
        location_type: 1,
        location_id: 0,
        flags: 3, // CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    }]
}

fn read_back(s: &Session, ctx: u64, ptr: u64, n: usize) -> Vec<u8> {
    let mut out = vec![0u8; n];
    s.memcpy_dtoh(ctx, LEGACY, ptr, &mut out).unwrap();
    out
}

/// Waits until the emulated GPU holds no virtual-memory object (a session's cleanup runs on
/// the server after its connection closes).
fn wait_vmm_gone(server: &Server) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let live = server.backend.live();
        if (
            live.vmm_allocations,
            live.vmm_reservations,
            live.vmm_mappings,
        ) == (0, 0, 0)
        {
            return;
        }
        assert!(Instant::now() < deadline, "still alive: {live:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn reserve_create_map_access_copy_and_free() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let server = serve(0);
    for transport in [TransportChoice::Unix, TransportChoice::Shm] {
        let s = session(&server.endpoint, transport);
        let ctx = s.primary_ctx_retain(0).unwrap();
        let prop = device_prop();
        assert_eq!(s.mem_get_granularity(ctx, prop.clone(), 0), Ok(G));
        assert_eq!(s.mem_get_granularity(ctx, prop.clone(), 1), Ok(G));

        let base = s.mem_address_reserve(ctx, 3 * G, 0, 0, 0).unwrap();
        assert!(
            matches!(s.pointer_kind(base + 5), PointerKind::Device { base: b, size, .. } if b == base && size == 3 * G),
            "a reserved range is device memory to unified addressing"
        );
        let h1 = s.mem_create(ctx, 2 * G, prop.clone(), 0).unwrap();
        let h2 = s.mem_create(ctx, G, prop.clone(), 0).unwrap();
        assert_eq!(s.mem_get_properties(ctx, h1), Ok(prop.clone()));
        assert_eq!(
            s.mem_create(ctx, G + 1, prop.clone(), 0),
            Err(CuError(cu::INVALID_VALUE)),
            "sizes come in granules"
        );

        s.mem_map(ctx, base, 2 * G, 0, h1, 0).unwrap();
        s.mem_map(ctx, base + 2 * G, G, 0, h2, 0).unwrap();
        // No access yet.
        assert_eq!(
            s.memcpy_htod(ctx, LEGACY, base, &[1, 2, 3]),
            Err(CuError(cu::INVALID_VALUE))
        );
        s.mem_set_access(ctx, base, 3 * G, read_write()).unwrap();
        assert_eq!(s.mem_get_access(ctx, base + 2 * G, (1, 0)), Ok(3));

        // Copies into both mappings, read back.
        let a = pattern(64 << 10, 1);
        let b = pattern(4096, 2);
        s.memcpy_htod(ctx, LEGACY, base + 100, &a).unwrap();
        s.memcpy_htod(ctx, LEGACY, base + 2 * G + 8, &b).unwrap();
        assert_eq!(read_back(&s, ctx, base + 100, a.len()), a);
        assert_eq!(read_back(&s, ctx, base + 2 * G + 8, b.len()), b);
        // A copy past the reservation is refused before the backend sees it.
        assert_eq!(
            s.memcpy_htod(ctx, LEGACY, base + 3 * G - 2, &[0; 4]),
            Err(CuError(cu::INVALID_VALUE))
        );

        // The same physical memory mapped twice: both addresses see the same bytes.
        let alias = s.mem_address_reserve(ctx, 2 * G, 0, 0, 0).unwrap();
        s.mem_map(ctx, alias, 2 * G, 0, h1, 0).unwrap();
        s.mem_set_access(ctx, alias, 2 * G, read_write()).unwrap();
        assert_eq!(read_back(&s, ctx, alias + 100, a.len()), a);

        // A handle retained by address is the session's handle of that allocation.
        assert_eq!(s.mem_retain_handle(ctx, base + 12345), Ok(h1));
        s.mem_release(ctx, h1).unwrap();
        assert_eq!(
            s.mem_retain_handle(ctx, base + 3 * G + 1),
            Err(CuError(cu::INVALID_VALUE)),
            "not mapped"
        );
        // A reservation is not a cuMemAlloc allocation.
        assert_eq!(s.mem_free(ctx, base), Err(CuError(cu::INVALID_VALUE)));

        // Releasing a mapped allocation keeps its memory until it is unmapped.
        s.mem_release(ctx, h1).unwrap();
        assert_eq!(read_back(&s, ctx, alias + 100, a.len()), a);
        assert_eq!(
            s.mem_get_properties(ctx, h1),
            Err(CuError(cu::INVALID_HANDLE)),
            "the session's handle is gone"
        );
        s.mem_unmap(ctx, alias, 2 * G).unwrap();
        s.mem_address_free(ctx, alias, 2 * G).unwrap();
        s.mem_unmap(ctx, base, 2 * G).unwrap();
        s.mem_unmap(ctx, base + 2 * G, G).unwrap();
        s.mem_release(ctx, h2).unwrap();
        assert_eq!(
            s.mem_address_free(ctx, base, G),
            Err(CuError(cu::INVALID_VALUE)),
            "the whole reservation or nothing"
        );
        s.mem_address_free(ctx, base, 3 * G).unwrap();
        assert!(matches!(s.pointer_kind(base), PointerKind::Host));
        assert_eq!(
            server.backend.live(),
            LiveCounts {
                contexts: server.backend.live().contexts,
                ..LiveCounts::default()
            }
        );
    }
}

#[test]
fn sessions_cannot_reach_each_others_virtual_memory() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let server = serve(0);
    let s = session(&server.endpoint, TransportChoice::Unix);
    let other = session(&server.endpoint, TransportChoice::Unix);
    let ctx = s.primary_ctx_retain(0).unwrap();
    let octx = other.primary_ctx_retain(0).unwrap();
    let base = s.mem_address_reserve(ctx, G, 0, 0, 0).unwrap();
    let h = s.mem_create(ctx, G, device_prop(), 0).unwrap();
    s.mem_map(ctx, base, G, 0, h, 0).unwrap();
    s.mem_set_access(ctx, base, G, read_write()).unwrap();
    s.memcpy_htod(ctx, LEGACY, base, &pattern(4096, 3)).unwrap();

    let own = other.mem_address_reserve(octx, G, 0, 0, 0).unwrap();
    assert_eq!(
        other.mem_map(octx, own, G, 0, h, 0),
        Err(CuError(cu::INVALID_HANDLE)),
        "another session's handle names nothing"
    );
    let oh = other.mem_create(octx, G, device_prop(), 0).unwrap();
    for r in [
        other.mem_map(octx, base, G, 0, oh, 0),
        other.mem_unmap(octx, base, G),
        other.mem_set_access(octx, base, G, read_write()),
        other.mem_address_free(octx, base, G),
        other.memcpy_htod(octx, LEGACY, base, &[0; 16]),
    ] {
        assert_eq!(r, Err(CuError(cu::INVALID_VALUE)));
    }
    assert_eq!(
        other.mem_retain_handle(octx, base),
        Err(CuError(cu::INVALID_VALUE))
    );
    assert_eq!(
        other.mem_get_access(octx, base, (1, 0)),
        Err(CuError(cu::INVALID_VALUE))
    );
    // The first session's data is untouched.
    assert_eq!(read_back(&s, ctx, base, 4096), pattern(4096, 3));
}

#[test]
fn a_session_that_ends_leaves_no_virtual_memory_behind() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let server = serve(0);
    {
        let s = session(&server.endpoint, TransportChoice::Unix);
        let ctx = s.primary_ctx_retain(0).unwrap();
        let base = s.mem_address_reserve(ctx, 4 * G, 0, 0, 0).unwrap();
        let h = s.mem_create(ctx, 2 * G, device_prop(), 0).unwrap();
        s.mem_map(ctx, base, 2 * G, 0, h, 0).unwrap();
        s.mem_map(ctx, base + 2 * G, 2 * G, 0, h, 0).unwrap();
        s.mem_retain_handle(ctx, base).unwrap();
        let unused = s.mem_create(ctx, G, device_prop(), 0).unwrap();
        assert_ne!(unused, h);
        let live = server.backend.live();
        assert_eq!(
            (
                live.vmm_allocations,
                live.vmm_reservations,
                live.vmm_mappings
            ),
            (2, 1, 2)
        );
        // Dropped with everything in place.
    }
    wait_vmm_gone(&server);
}
