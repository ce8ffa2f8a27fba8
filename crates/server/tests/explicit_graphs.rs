//! Explicit CUDA graphs (protocol revision 11) end to end: client `Session` → executor →
//! EMULATED backend. Kernel, memset, memcpy, host, child graph, event and empty nodes with
//! dependencies run in a topological order at every launch; node queries, parameters read
//! back and set (in the graph and in an executable graph), clone, executable graph update;
//! memcpy nodes with a host side in the shared data area read and write it when the graph
//! runs (and are refused elsewhere); another session cannot use a session's node or graph
//! handles; a session that ends frees its graphs.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use common::*;
use remora_client::proto::{
    RmGraphCopySide, RmGraphMemKind, RmMemcpyNode, RmMemsetNode, RmNodeParams,
};
use remora_client::{FunctionInfo, NodeList, Session};
use remora_oncrpc::TransportChoice;

const INVALID_VALUE: i32 = 1;
const INVALID_HANDLE: i32 = 400;
const NOT_SUPPORTED: i32 = 801;
const KERNEL: i32 = 0;
const MEMCPY: i32 = 1;
const MEMSET: i32 = 2;
const HOST: i32 = 3;
const EMPTY: i32 = 5;
const N: u64 = 64;

fn memset(dst: u64, value: u32, bytes: u64) -> RmNodeParams {
    RmNodeParams::RmNodeMemset(RmMemsetNode {
        dst,
        pitch: 0,
        value,
        element_size: 1,
        width: bytes,
        height: 1,
    })
}

fn side(kind: RmGraphMemKind, addr: u64, n: u64) -> RmGraphCopySide {
    RmGraphCopySide {
        kind,
        addr,
        pitch: n,
        height: 1,
        x_bytes: 0,
        y: 0,
        z: 0,
    }
}

/// A device side as `cudaGraphAddMemcpyNode1D` gives it: no pitch, no height (one row).
fn dev(addr: u64) -> RmGraphCopySide {
    RmGraphCopySide {
        pitch: 0,
        height: 0,
        ..side(RmGraphMemKind::RmGraphMemDevice, addr, N)
    }
}

fn memcpy(src: RmGraphCopySide, dst: RmGraphCopySide) -> RmNodeParams {
    RmNodeParams::RmNodeMemcpy(RmMemcpyNode {
        src,
        dst,
        width_bytes: N,
        height: 1,
        depth: 1,
    })
}

fn read(s: &Session, ctx: u64, src: u64) -> Vec<u8> {
    let mut out = vec![0; N as usize];
    s.memcpy_dtoh(ctx, LEGACY, src, &mut out).unwrap();
    out
}

fn i32s(b: &[u8]) -> Vec<i32> {
    b.chunks(4)
        .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// A `fill_i32(p, v, n)` kernel node of 16 threads.
fn fill(s: &Session, f: &FunctionInfo, p: u64, v: i32) -> RmNodeParams {
    let n = (N / 4) as i32;
    let args: [*const std::ffi::c_void; 3] = [
        (&p as *const u64).cast(),
        (&v as *const i32).cast(),
        (&n as *const i32).cast(),
    ];
    // SAFETY: one valid pointer per parameter of fill_i32(int*, int, int).
    let k = unsafe { s.kernel_node(f, [1, 1, 1], [16, 1, 1], 0, args.as_ptr()) }.unwrap();
    RmNodeParams::RmNodeKernel(k)
}

fn fill_function(s: &Session, ctx: u64) -> Arc<FunctionInfo> {
    let m = s
        .module_load(ctx, b"REMORA-EMU-MODULE\nfunc fill_i32 8,4,4\n")
        .unwrap();
    Arc::clone(&m.functions["fill_i32"])
}

fn code<T: std::fmt::Debug>(r: remora_client::CuResult<T>) -> i32 {
    r.unwrap_err().code()
}

fn expected_fill(v: i32) -> Vec<i32> {
    (0..(N / 4) as i32).map(|i| v + i).collect()
}

#[test]
fn nodes_with_dependencies_run_in_order_and_can_be_queried_and_changed() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let server = serve(4 * AREA);
    for transport in [TransportChoice::Unix, TransportChoice::Shm] {
        let s = session(&server.endpoint, transport);
        let ctx = s.primary_ctx_retain(0).unwrap();
        let f = fill_function(&s, ctx);
        let [a, b, c, d] = [0; 4].map(|_| s.mem_alloc(ctx, N).unwrap());
        let stream = s.stream_create(ctx, 1, 0).unwrap();

        let g = s.graph_create(ctx, 0).unwrap();
        // a = 0x11..; c = a (after the memset). b = fill(7); d = b (after the kernel).
        let ms = s.graph_add_node(g, 0, &[], memset(a, 0x11, N)).unwrap();
        let k = s.graph_add_node(g, 0, &[], fill(&s, &f, b, 7)).unwrap();
        let cp1 = s
            .graph_add_node(g, 0, &[ms], memcpy(dev(a), dev(c)))
            .unwrap();
        let cp2 = s
            .graph_add_node(g, 0, &[k], memcpy(dev(b), dev(d)))
            .unwrap();
        let end = s
            .graph_add_node(g, 0, &[cp1, cp2], RmNodeParams::RmNodeEmpty)
            .unwrap();

        let mut nodes = s.graph_node_list(g, NodeList::Nodes).unwrap();
        nodes.sort();
        let mut all = vec![ms, k, cp1, cp2, end];
        all.sort();
        assert_eq!(nodes, all);
        let mut roots = s.graph_node_list(g, NodeList::Roots).unwrap();
        roots.sort();
        let mut want = vec![ms, k];
        want.sort();
        assert_eq!(roots, want);
        let (from, to) = s.graph_edges(g).unwrap();
        assert_eq!(from.len(), 4);
        assert!(from.iter().zip(&to).any(|(f, t)| (*f, *t) == (k, cp2)));
        assert_eq!(s.graph_node_count(g).unwrap(), 5);
        assert_eq!(s.graph_node_type(k).unwrap(), KERNEL);
        assert_eq!(s.graph_node_type(ms).unwrap(), MEMSET);
        assert_eq!(s.graph_node_type(cp1).unwrap(), MEMCPY);
        assert_eq!(s.graph_node_type(end).unwrap(), EMPTY);
        let mut deps = s.graph_node_list(end, NodeList::Dependencies).unwrap();
        deps.sort();
        let mut want = vec![cp1, cp2];
        want.sort();
        assert_eq!(deps, want);
        assert_eq!(
            s.graph_node_list(k, NodeList::Dependents).unwrap(),
            vec![cp2]
        );
        // A node of this graph as a dependency of itself, a dependency twice: refused.
        assert_eq!(
            code(s.graph_change_dependencies(g, &[k], &[cp2], true)),
            INVALID_VALUE
        );

        // Kernel parameters read back as they were packed.
        let RmNodeParams::RmNodeKernel(kp) = s.graph_node_params(k).unwrap() else {
            panic!("a kernel node");
        };
        assert_eq!(kp.function, f.handle);
        assert_eq!(&kp.params[8..12], &7i32.to_le_bytes());

        let exec = s.graph_instantiate(ctx, g, 0).unwrap();
        for round in 0..2 {
            s.memset(&remora_client::proto::RmMemsetArgs {
                ctx,
                stream: LEGACY,
                dst: c,
                value: 0,
                element_size: 1,
                count: N,
            })
            .unwrap();
            s.graph_launch(ctx, exec, stream).unwrap();
            s.stream_synchronize(ctx, stream).unwrap();
            assert_eq!(read(&s, ctx, c), vec![0x11; N as usize], "round {round}");
            assert_eq!(i32s(&read(&s, ctx, d)), expected_fill(7), "round {round}");
        }

        // cuGraphExecKernelNodeSetParams and cuGraphExecMemsetNodeSetParams change the
        // executable graph only.
        s.graph_exec_node_set_params(exec, k, fill(&s, &f, b, 100))
            .unwrap();
        s.graph_exec_node_set_params(exec, ms, memset(a, 0x22, N))
            .unwrap();
        assert_eq!(
            code(s.graph_exec_node_set_params(exec, ms, fill(&s, &f, b, 1))),
            INVALID_VALUE,
            "a node keeps its type"
        );
        s.graph_launch(ctx, exec, stream).unwrap();
        s.stream_synchronize(ctx, stream).unwrap();
        assert_eq!(read(&s, ctx, c), vec![0x22; N as usize]);
        assert_eq!(i32s(&read(&s, ctx, d)), expected_fill(100));
        let RmNodeParams::RmNodeMemset(m) = s.graph_node_params(ms).unwrap() else {
            panic!("a memset node");
        };
        assert_eq!(m.value, 0x11, "the graph keeps its own parameters");

        // Set in the graph, cloned, updated into the executable graph.
        s.graph_node_set_params(ms, memset(a, 0x33, N)).unwrap();
        let clone = s.graph_clone(g).unwrap();
        assert_eq!(s.graph_node_count(clone).unwrap(), 5);
        s.graph_node_set_params(k, fill(&s, &f, b, -5)).unwrap();
        let (r, info) = s.graph_exec_update(exec, g);
        r.unwrap();
        assert_eq!(info.result, 0);
        s.graph_launch(ctx, exec, stream).unwrap();
        s.stream_synchronize(ctx, stream).unwrap();
        assert_eq!(read(&s, ctx, c), vec![0x33; N as usize]);
        assert_eq!(i32s(&read(&s, ctx, d)), expected_fill(-5));

        // The clone has the parameters of the moment it was made.
        let cexec = s.graph_instantiate(ctx, clone, 0).unwrap();
        s.graph_launch(ctx, cexec, stream).unwrap();
        s.stream_synchronize(ctx, stream).unwrap();
        assert_eq!(i32s(&read(&s, ctx, d)), expected_fill(7));

        // An update with another topology fails and says why.
        s.graph_destroy_node(end).unwrap();
        assert_eq!(code(s.graph_node_type(end)), INVALID_HANDLE);
        let (r, info) = s.graph_exec_update(exec, g);
        assert_eq!(r.unwrap_err().code(), 910);
        assert_eq!(
            info.result, 2,
            "CU_GRAPH_EXEC_UPDATE_ERROR_TOPOLOGY_CHANGED"
        );

        // Removing an edge makes the copy a root.
        s.graph_change_dependencies(g, &[k], &[cp2], false).unwrap();
        assert_eq!(s.graph_node_list(g, NodeList::Roots).unwrap().len(), 3);

        // A memset outside the session's memory is refused when the node is added.
        assert_eq!(
            code(s.graph_add_node(g, 0, &[], memset(a, 0, N + 1))),
            INVALID_VALUE
        );

        s.graph_exec_destroy(cexec).unwrap();
        s.graph_exec_destroy(exec).unwrap();
        s.graph_destroy(clone).unwrap();
        s.graph_destroy(g).unwrap();
        // Its nodes went with it.
        assert_eq!(code(s.graph_node_type(k)), INVALID_HANDLE);
    }
}

#[test]
fn host_child_and_event_nodes_run_at_every_launch() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let server = serve(4 * AREA);
    let s = session(&server.endpoint, TransportChoice::Unix);
    let ctx = s.primary_ctx_retain(0).unwrap();
    let [a, b] = [0; 2].map(|_| s.mem_alloc(ctx, N).unwrap());
    let stream = s.stream_create(ctx, 1, 0).unwrap();
    let event = s.event_create(ctx, 0).unwrap();

    let child = s.graph_create(ctx, 0).unwrap();
    s.graph_add_node(child, 0, &[], memset(b, 0x44, N)).unwrap();

    let g = s.graph_create(ctx, 0).unwrap();
    let ms = s.graph_add_node(g, 0, &[], memset(a, 0x55, N)).unwrap();
    let runs = Arc::new(AtomicUsize::new(0));
    let r = Arc::clone(&runs);
    let host = s
        .graph_add_host_node(
            g,
            &[ms],
            Arc::new(move || {
                r.fetch_add(1, Ordering::SeqCst);
            }),
        )
        .unwrap();
    assert_eq!(s.graph_node_type(host).unwrap(), HOST);
    let ch = s
        .graph_add_node(g, 0, &[host], RmNodeParams::RmNodeGraph(child))
        .unwrap();
    s.graph_add_node(g, 0, &[ch], RmNodeParams::RmNodeEventRecord(event))
        .unwrap();
    s.graph_add_node(g, 0, &[], RmNodeParams::RmNodeEventWait(event))
        .unwrap();
    // The child was copied into the node: changing it now changes nothing.
    s.graph_add_node(child, 0, &[], memset(b, 0x66, N)).unwrap();

    let exec = s.graph_instantiate(ctx, g, 0).unwrap();
    for round in 1..=3 {
        s.graph_launch(ctx, exec, stream).unwrap();
        s.stream_synchronize(ctx, stream).unwrap();
        assert_eq!(runs.load(Ordering::SeqCst), round);
    }
    assert_eq!(read(&s, ctx, a), vec![0x55; N as usize]);
    assert_eq!(read(&s, ctx, b), vec![0x44; N as usize]);
    assert!(s.event_query(event).unwrap());
    s.graph_exec_destroy(exec).unwrap();
    s.graph_destroy(g).unwrap();
    s.graph_destroy(child).unwrap();
}

#[test]
fn memcpy_nodes_reach_pinned_memory_in_the_data_area_when_the_graph_runs() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let server = serve(4 * AREA);
    let s = session(&server.endpoint, TransportChoice::Shm);
    let ctx = s.primary_ctx_retain(0).unwrap();
    let d = s.mem_alloc(ctx, N).unwrap();
    let src = s.host_memory().alloc(N, 0, ctx).unwrap();
    let dst = s.host_memory().alloc(N, 0, ctx).unwrap();
    let (so, dso) = (
        s.graph_host_side("test", src, N).unwrap(),
        s.graph_host_side("test", dst, N).unwrap(),
    );
    let area = RmGraphMemKind::RmGraphMemArea;
    let g = s.graph_create(ctx, 0).unwrap();
    let up = s
        .graph_add_node(g, 0, &[], memcpy(side(area, so, N), dev(d)))
        .unwrap();
    let down = s
        .graph_add_node(g, 0, &[up], memcpy(dev(d), side(area, dso, N)))
        .unwrap();
    let RmNodeParams::RmNodeMemcpy(p) = s.graph_node_params(down).unwrap() else {
        panic!("a memcpy node");
    };
    assert_eq!(p.dst.kind, area);
    assert_eq!(s.area_host_ptr(p.dst.addr).unwrap(), dst);
    let exec = s.graph_instantiate(ctx, g, 0).unwrap();
    // SAFETY: live allocations of N bytes used only here.
    let (hs, hd) = unsafe {
        (
            std::slice::from_raw_parts_mut(src as usize as *mut u8, N as usize),
            std::slice::from_raw_parts_mut(dst as usize as *mut u8, N as usize),
        )
    };
    for round in 0..3u8 {
        // Written after the graph was built: the launch reads what is there now.
        hs.fill(round + 1);
        s.graph_launch(ctx, exec, LEGACY).unwrap();
        s.stream_synchronize(ctx, LEGACY).unwrap();
        assert_eq!(hd, &vec![round + 1; N as usize][..]);
    }
    // A span past the end of the area is refused by the server.
    let bad = side(area, u64::MAX - 8, N);
    assert_eq!(
        code(s.graph_add_node(g, 0, &[], memcpy(bad, dev(d)))),
        INVALID_VALUE
    );
    // Pageable memory cannot be reached when the graph runs.
    let pageable = vec![0u8; N as usize];
    assert_eq!(
        code(s.graph_host_side("test", pageable.as_ptr() as u64, N)),
        NOT_SUPPORTED
    );

    // Over a socket there is no data area.
    let u = session(&server.endpoint, TransportChoice::Unix);
    let uctx = u.primary_ctx_retain(0).unwrap();
    let p = u.host_memory().alloc(N, 0, uctx).unwrap();
    assert_eq!(code(u.graph_host_side("test", p, N)), NOT_SUPPORTED);
    let ud = u.mem_alloc(uctx, N).unwrap();
    let ug = u.graph_create(uctx, 0).unwrap();
    assert_eq!(
        code(u.graph_add_node(ug, 0, &[], memcpy(side(area, 0, N), dev(ud)))),
        INVALID_VALUE
    );
}

#[test]
fn handles_are_per_session_and_freed_at_the_end() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let server = serve(4 * AREA);
    let graphs_before = server.backend.live().graphs;
    let s = session(&server.endpoint, TransportChoice::Unix);
    let ctx = s.primary_ctx_retain(0).unwrap();
    let a = s.mem_alloc(ctx, N).unwrap();
    // Handles are per session: make this session's graph handles numbers the other session
    // has not handed out, so that they name nothing there.
    for _ in 0..32 {
        s.event_create(ctx, 0).unwrap();
    }
    let g = s.graph_create(ctx, 0).unwrap();
    let n = s.graph_add_node(g, 0, &[], memset(a, 1, N)).unwrap();
    let exec = s.graph_instantiate(ctx, g, 0).unwrap();

    let other = session(&server.endpoint, TransportChoice::Unix);
    let octx = other.primary_ctx_retain(0).unwrap();
    let og = other.graph_create(octx, 0).unwrap();
    assert_eq!(code(other.graph_node_type(n)), INVALID_HANDLE);
    assert_eq!(code(other.graph_node_params(n)), INVALID_HANDLE);
    assert_eq!(code(other.graph_clone(g)), INVALID_HANDLE);
    assert_eq!(
        code(other.graph_add_node(og, 0, &[n], RmNodeParams::RmNodeEmpty)),
        INVALID_HANDLE
    );
    assert_eq!(
        code(other.graph_exec_node_set_params(exec, n, memset(a, 2, N))),
        INVALID_HANDLE
    );
    // Its memory is not this session's either.
    assert_eq!(
        code(other.graph_add_node(og, 0, &[], memset(a, 2, N))),
        INVALID_VALUE
    );
    // A node of another graph of the same session is no dependency.
    let g2 = s.graph_create(ctx, 0).unwrap();
    assert_eq!(
        code(s.graph_add_node(g2, 0, &[n], RmNodeParams::RmNodeEmpty)),
        INVALID_VALUE
    );
    drop(other);
    drop(s);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while server.backend.live().graphs != graphs_before || server.backend.live().graph_execs != 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "graphs left: {:?}",
            server.backend.live()
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}
