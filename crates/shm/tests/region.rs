//! A region made by one side and mapped from its descriptor by the other.

use std::sync::Mutex;
use std::time::Duration;

use remora_shm::{Layout, Region, RegionError, Waiter};

const LAYOUT: Layout = Layout {
    ring_capacity: 1 << 16,
    data_size: 1 << 20,
};

/// The tests of this file map memory; one of them needs an address range to stay free
/// between finding it and mapping it, so they run one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

#[test]
fn both_sides_see_the_same_rings_and_data() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let server = Region::create("remora-test", LAYOUT).unwrap();
    let fd = server.fd().try_clone().unwrap();
    let client = Region::open(fd, LAYOUT).unwrap();
    let mut req = client.request_producer();
    let mut req_in = server.request_consumer();
    let mut resp = server.response_producer();
    let mut resp_in = client.response_consumer();
    let mut w = Waiter::new(Duration::from_micros(1), Duration::from_micros(20));
    let mut buf = Vec::new();
    for i in 0..1000u32 {
        req.push(&[b"call ", &i.to_be_bytes()], &mut w, || true)
            .unwrap();
        req_in.pop(&mut buf, &mut w, || true).unwrap();
        assert_eq!(&buf[5..], &i.to_be_bytes());
        resp.push(&[&buf], &mut w, || true).unwrap();
        resp_in.pop(&mut buf, &mut w, || true).unwrap();
        assert_eq!(&buf[..5], b"call ");
    }
    // The data area is the same memory on both sides.
    let (s, len) = server.data();
    let (c, clen) = client.data();
    assert_eq!(len, clen);
    // SAFETY: both point at `len` bytes of the same live shared mapping, touched by no one else.
    unsafe {
        s.add(123).write(0xAB);
        assert_eq!(c.add(123).read(), 0xAB);
    }
}

#[test]
fn a_descriptor_that_does_not_match_is_refused() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let server = Region::create("remora-test", LAYOUT).unwrap();
    let other = Layout {
        ring_capacity: 1 << 17,
        ..LAYOUT
    };
    let err = Region::open(server.fd().try_clone().unwrap(), other).unwrap_err();
    assert!(matches!(err, RegionError::Mismatch(_)), "{err}");
    // A plain memfd of the right size, unsealed and without a header.
    let fd = rustix::fs::memfd_create("fake", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
    rustix::fs::ftruncate(&fd, server.layout().total() as u64).unwrap();
    let err = Region::open(fd, LAYOUT).unwrap_err();
    assert!(err.to_string().contains("not sealed"), "{err}");
    // Impossible layouts are refused before anything is made.
    let bad = Layout {
        ring_capacity: 5000,
        data_size: 0,
    };
    assert!(matches!(
        Region::create("remora-test", bad),
        Err(RegionError::Layout(_))
    ));
}

#[test]
fn a_client_maps_the_region_at_the_servers_address_when_it_is_free() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let server = Region::create("remora-test", LAYOUT).unwrap();
    // A range that is free in this process: reserve it, note it, give it back.
    // SAFETY: a fresh private mapping, unmapped again at once and never touched.
    let free = unsafe {
        let p = rustix::mm::mmap_anonymous(
            std::ptr::null_mut(),
            LAYOUT.total(),
            rustix::mm::ProtFlags::empty(),
            rustix::mm::MapFlags::PRIVATE,
        )
        .unwrap();
        rustix::mm::munmap(p, LAYOUT.total()).unwrap();
        p as usize
    };
    let fd = server.fd().try_clone().unwrap();
    let client = Region::open_at(fd, LAYOUT, Some(free)).unwrap();
    assert_eq!(client.base_address(), free);
    assert!(client.data_area().same_address_as_peer());
    // Where the range is taken (here: by the server's own mapping, in this one process) the
    // client maps elsewhere, says so, and still shares the memory.
    let fd = server.fd().try_clone().unwrap();
    let other = Region::open_at(fd, LAYOUT, Some(server.base_address())).unwrap();
    assert_ne!(other.base_address(), server.base_address());
    assert!(!other.data_area().same_address_as_peer());
    assert!(!server.data_area().same_address_as_peer());
    let (s, _) = server.data();
    let (c, _) = other.data();
    // SAFETY: both point into the same live shared data area, touched by no one else.
    unsafe {
        s.add(7).write(0x5A);
        assert_eq!(c.add(7).read(), 0x5A);
    }
}
