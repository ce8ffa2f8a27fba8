//! Graphs and memory (protocol revision 12) end to end: client `Session` → executor →
//! EMULATED backend, over unix, shm and tcp.
//! * memory allocation and free nodes: the address is device memory for the client and a
//!   range of the session while a graph holds it or a launch left it allocated; node types
//!   and parameters read back; the graph memory attributes and trim;
//! * memcpy nodes and captured copies whose host side is pageable memory: every launch sees
//!   the host bytes of that moment and writes every byte of the destination rows (and none
//!   between them), also when launches on two streams follow each other unsynchronized;
//! * what cannot be staged correctly is refused loudly.

mod common;

use common::*;
use remora_client::proto::{
    RmGraphCopySide, RmGraphMemKind, RmMemAllocNode, RmMemcpyNode, RmMemsetNode, RmNodeParams,
    RmPoolLocation,
};
use remora_client::{PointerKind, Session};
use remora_oncrpc::TransportChoice;

const INVALID_VALUE: i32 = 1;
const NOT_SUPPORTED: i32 = 801;
const MEM_ALLOC: i32 = 10;
const MEM_FREE: i32 = 11;
const N: u64 = 64;

fn sessions(server: &Server) -> Vec<Session> {
    vec![
        session(&server.endpoint, TransportChoice::Unix),
        session(&server.endpoint, TransportChoice::Shm),
        session(&server.tcp(), TransportChoice::Tcp),
    ]
}

fn code<T: std::fmt::Debug>(r: remora_client::CuResult<T>) -> i32 {
    r.expect_err("expected an error").0
}

fn alloc_node(bytes: u64) -> RmMemAllocNode {
    RmMemAllocNode {
        location: RmPoolLocation { kind: 1, id: 0 },
        access: Vec::new(),
        bytesize: bytes,
        dptr: 0,
    }
}

fn dev_side(addr: u64, pitch: u64) -> RmGraphCopySide {
    RmGraphCopySide {
        kind: RmGraphMemKind::RmGraphMemDevice,
        addr,
        pitch,
        height: 0,
        x_bytes: 0,
        y: 0,
        z: 0,
    }
}

fn copy(src: RmGraphCopySide, dst: RmGraphCopySide, w: u64, h: u64) -> RmNodeParams {
    RmNodeParams::RmNodeMemcpy(RmMemcpyNode {
        src,
        dst,
        width_bytes: w,
        height: h,
        depth: 1,
    })
}

fn read(s: &Session, ctx: u64, src: u64, n: u64) -> Vec<u8> {
    let mut out = vec![0; n as usize];
    s.memcpy_dtoh(ctx, LEGACY, src, &mut out).unwrap();
    out
}

#[test]
fn memory_nodes_allocate_and_free_at_every_launch() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let server = serve(4 * AREA);
    for s in sessions(&server) {
        let ctx = s.primary_ctx_retain(0).unwrap();
        let out = s.mem_alloc(ctx, N).unwrap();
        let g = s.graph_create(ctx, 0).unwrap();
        let (a, p) = s
            .graph_add_mem_alloc_node(g, ctx, &[], alloc_node(N))
            .unwrap();
        assert!(matches!(s.pointer_kind(p), PointerKind::Device { .. }));
        let set = s
            .graph_add_node(
                g,
                0,
                &[a],
                RmNodeParams::RmNodeMemset(RmMemsetNode {
                    dst: p,
                    pitch: 0,
                    value: 0x5a,
                    element_size: 1,
                    width: N,
                    height: 1,
                }),
            )
            .unwrap();
        let cp = s
            .graph_add_node(g, 0, &[set], copy(dev_side(p, 0), dev_side(out, 0), N, 1))
            .unwrap();
        let f = s
            .graph_add_node(g, 0, &[cp], RmNodeParams::RmNodeMemFree(p))
            .unwrap();
        assert_eq!(s.graph_node_type(a).unwrap(), MEM_ALLOC);
        assert_eq!(s.graph_node_type(f).unwrap(), MEM_FREE);
        let RmNodeParams::RmNodeMemAlloc(m) = s.graph_node_params(a).unwrap() else {
            panic!("an allocation node");
        };
        assert_eq!((m.dptr, m.bytesize, m.location.id), (p, N, 0));
        assert!(matches!(
            s.graph_node_params(f).unwrap(),
            RmNodeParams::RmNodeMemFree(x) if x == p
        ));
        // Only graph allocations can be freed by a node.
        assert_eq!(
            code(s.graph_add_node(g, 0, &[], RmNodeParams::RmNodeMemFree(out))),
            INVALID_VALUE
        );
        let exec = s.graph_instantiate(ctx, g, 0).unwrap();
        for _ in 0..3 {
            s.memset(&remora_client::proto::RmMemsetArgs {
                ctx,
                stream: LEGACY,
                dst: out,
                value: 0,
                element_size: 1,
                count: N,
            })
            .unwrap();
            s.graph_launch(ctx, exec, LEGACY).unwrap();
            s.stream_synchronize(ctx, LEGACY).unwrap();
            assert_eq!(read(&s, ctx, out, N), vec![0x5a; N as usize]);
        }
        // Freed at every launch: nothing used, something reserved until a trim.
        assert_eq!(s.graph_mem_attribute(0, 0).unwrap(), 0);
        assert!(s.graph_mem_attribute(0, 2).unwrap() >= N);
        s.graph_mem_trim(0).unwrap();
        assert_eq!(s.graph_mem_attribute(0, 2).unwrap(), 0);
        s.set_graph_mem_attribute(0, 1, 0).unwrap();
        assert_eq!(code(s.set_graph_mem_attribute(0, 0, 0)), INVALID_VALUE);
        s.graph_exec_destroy(exec).unwrap();
        s.graph_destroy(g).unwrap();
        // Nothing holds the address now: copies into it are refused.
        assert_eq!(
            code(s.memcpy_htod(ctx, LEGACY, p, &[1u8; 8])),
            INVALID_VALUE
        );

        // An allocation without a free node stays allocated after the launch, also after
        // its graph and executable graph are gone, until cuMemFree.
        let g = s.graph_create(ctx, 0).unwrap();
        let (_, q) = s
            .graph_add_mem_alloc_node(g, ctx, &[], alloc_node(N))
            .unwrap();
        let exec = s.graph_instantiate(ctx, g, 0).unwrap();
        s.graph_destroy(g).unwrap();
        s.graph_launch(ctx, exec, LEGACY).unwrap();
        s.stream_synchronize(ctx, LEGACY).unwrap();
        assert!(s.graph_mem_attribute(0, 0).unwrap() >= N);
        s.graph_exec_destroy(exec).unwrap();
        let data = pattern(N as usize, 3);
        s.memcpy_htod(ctx, LEGACY, q, &data).unwrap();
        assert_eq!(read(&s, ctx, q, N), data);
        s.mem_free(ctx, q).unwrap();
        assert_eq!(s.graph_mem_attribute(0, 0).unwrap(), 0);
        assert_eq!(code(s.memcpy_htod(ctx, LEGACY, q, &data)), INVALID_VALUE);
        // The reservation stays: the address is never taken for host memory.
        assert!(matches!(s.pointer_kind(q), PointerKind::Device { .. }));

        // Freed by a free node of another graph (the graphMemoryNodes sample): allowed, and a
        // launch of that graph frees it.
        let g = s.graph_create(ctx, 0).unwrap();
        let (_, r) = s
            .graph_add_mem_alloc_node(g, ctx, &[], alloc_node(N))
            .unwrap();
        let exec = s.graph_instantiate(ctx, g, 0).unwrap();
        s.graph_destroy(g).unwrap();
        s.graph_launch(ctx, exec, LEGACY).unwrap();
        s.stream_synchronize(ctx, LEGACY).unwrap();
        let fg = s.graph_create(ctx, 0).unwrap();
        s.graph_add_node(fg, 0, &[], RmNodeParams::RmNodeMemFree(r))
            .unwrap();
        let fexec = s.graph_instantiate(ctx, fg, 0).unwrap();
        s.graph_destroy(fg).unwrap();
        s.memcpy_htod(ctx, LEGACY, r, &data).unwrap();
        assert_eq!(read(&s, ctx, r, N), data);
        s.graph_launch(ctx, fexec, LEGACY).unwrap();
        s.stream_synchronize(ctx, LEGACY).unwrap();
        assert_eq!(s.graph_mem_attribute(0, 0).unwrap(), 0);
        // Allocated again by the next launch of its graph, freed again by the other.
        s.graph_launch(ctx, exec, LEGACY).unwrap();
        s.memcpy_htod(ctx, LEGACY, r, &data).unwrap();
        s.graph_launch(ctx, fexec, LEGACY).unwrap();
        s.stream_synchronize(ctx, LEGACY).unwrap();
        assert_eq!(s.graph_mem_attribute(0, 0).unwrap(), 0);
        s.graph_exec_destroy(fexec).unwrap();
        s.graph_exec_destroy(exec).unwrap();
        assert_eq!(code(s.memcpy_htod(ctx, LEGACY, r, &data)), INVALID_VALUE);
    }
}

/// A node's pageable side: the staged device side and its record.
fn staged(
    s: &Session,
    ctx: u64,
    host: u64,
    pitch: u64,
    extent: (u64, u64),
    to_device: bool,
) -> (RmGraphCopySide, remora_client::StagedSide) {
    let side = RmGraphCopySide {
        addr: host,
        height: extent.1,
        ..dev_side(0, pitch)
    };
    // SAFETY: the test keeps the buffer at `host` alive (and in place) for every launch.
    unsafe { s.graph_stage_host_side(ctx, side, (extent.0, extent.1, 1), to_device) }.unwrap()
}

#[test]
fn pageable_memcpy_nodes_see_fresh_host_bytes_at_every_launch() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let server = serve(4 * AREA);
    for s in sessions(&server) {
        let ctx = s.primary_ctx_retain(0).unwrap();
        // 2-D: 3 rows of W bytes; the source rows are 2W apart, the destination rows 3W.
        const W: u64 = 24;
        let d = s.mem_alloc(ctx, 3 * W).unwrap();
        let mut src = vec![0u8; (2 * W * 3) as usize];
        let mut dst = vec![0xeeu8; (3 * W * 3) as usize];
        let g = s.graph_create(ctx, 0).unwrap();
        let (up_src, up) = staged(&s, ctx, src.as_ptr() as u64, 2 * W, (W, 3), true);
        let n1 = s
            .graph_add_node(g, 0, &[], copy(up_src, dev_side(d, W), W, 3))
            .unwrap();
        s.graph_bind_sides(g, n1, vec![up]);
        let (down_dst, down) = staged(&s, ctx, dst.as_mut_ptr() as u64, 3 * W, (W, 3), false);
        let n2 = s
            .graph_add_node(g, 0, &[n1], copy(dev_side(d, W), down_dst.clone(), W, 3))
            .unwrap();
        s.graph_bind_sides(g, n2, vec![down]);
        // Read back, the staged side is the host side the program gave.
        let RmNodeParams::RmNodeMemcpy(p) = s.graph_node_params(n2).unwrap() else {
            panic!("a memcpy node");
        };
        assert_eq!(
            s.graph_host_side_of(p.dst.addr).unwrap().addr,
            dst.as_ptr() as u64
        );
        let exec = s.graph_instantiate(ctx, g, 0).unwrap();
        let streams = [LEGACY, s.stream_create(ctx, 1, 0).unwrap()];
        let expect = |src: &[u8]| {
            let mut e = vec![0xeeu8; (3 * W * 3) as usize];
            for r in 0..3 {
                let (so, d_o) = ((r * 2 * W) as usize, (r * 3 * W) as usize);
                e[d_o..d_o + W as usize].copy_from_slice(&src[so..so + W as usize]);
            }
            e
        };
        for round in 0..6u32 {
            // Written after the graph was built and before each launch.
            let fresh = pattern(src.len(), round);
            src.copy_from_slice(&fresh);
            s.graph_launch(ctx, exec, streams[round as usize % 2])
                .unwrap();
            s.ctx_synchronize(ctx).unwrap();
            assert_eq!(dst, expect(&src), "round {round}");
        }
        // Unsynchronized launches on two streams: the last one's bytes win.
        for round in 10..14u32 {
            let fresh = pattern(src.len(), round);
            src.copy_from_slice(&fresh);
            s.graph_launch(ctx, exec, streams[round as usize % 2])
                .unwrap();
        }
        s.ctx_synchronize(ctx).unwrap();
        assert_eq!(dst, expect(&src));

        // Host nodes and pageable sides in one graph: refused, never stale.
        let h = s
            .graph_add_host_node(g, &[n2], std::sync::Arc::new(|| {}))
            .unwrap();
        assert_eq!(code(s.graph_instantiate(ctx, g, 0)), NOT_SUPPORTED);
        s.graph_destroy_node(h).unwrap();
        s.graph_exec_destroy(exec).unwrap();
        s.graph_destroy(g).unwrap();
    }
}

#[test]
fn captured_copies_of_pageable_memory_run_at_every_launch() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let server = serve(4 * AREA);
    for s in sessions(&server) {
        let ctx = s.primary_ctx_retain(0).unwrap();
        let a = s.mem_alloc(ctx, N).unwrap();
        let b = s.mem_alloc(ctx, N).unwrap();
        let stream = s.stream_create(ctx, 1, 0).unwrap();
        let mut src = vec![0u8; N as usize];
        let mut sum = [0u8; 8];
        s.stream_begin_capture(ctx, stream, 0).unwrap();
        // SAFETY: `src` and `sum` stay alive and in place for every launch below.
        unsafe {
            s.graph_capture_host_copy(ctx, stream, a, src.as_ptr() as u64, N, true)
                .unwrap();
        }
        s.memcpy_dtod_async(ctx, stream, b, a + 8, 8).unwrap();
        // SAFETY: as above.
        unsafe {
            s.graph_capture_host_copy(ctx, stream, b, sum.as_mut_ptr() as u64, 8, false)
                .unwrap();
        }
        let g = s.stream_end_capture(ctx, stream).unwrap();
        let exec = s.graph_instantiate(ctx, g, 0).unwrap();
        for round in 0..5u32 {
            src.copy_from_slice(&pattern(N as usize, round));
            s.graph_launch(ctx, exec, stream).unwrap();
            s.stream_synchronize(ctx, stream).unwrap();
            assert_eq!(&sum[..], &src[8..16], "round {round}");
        }

        // A captured upload of memory an earlier captured download writes: refused, and
        // the capture fails.
        s.stream_begin_capture(ctx, stream, 0).unwrap();
        // SAFETY: as above.
        unsafe {
            s.graph_capture_host_copy(ctx, stream, a, src.as_mut_ptr() as u64, N, false)
                .unwrap();
            assert_eq!(
                code(s.graph_capture_host_copy(ctx, stream, b, src.as_ptr() as u64 + 8, 8, true)),
                NOT_SUPPORTED
            );
        }
        assert_eq!(code(s.stream_end_capture(ctx, stream)), NOT_SUPPORTED);
        s.graph_exec_destroy(exec).unwrap();
        s.graph_destroy(g).unwrap();
    }
}
