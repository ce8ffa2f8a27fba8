//! The per-kernel wait prediction (`REMORA_WAIT_PER_KERNEL=1`, an experiment) against the
//! emulated backend with one slow kernel: after a few synchronizes the long kernel's make the
//! full call at once, the short kernel's are still seen in shared memory, and every result
//! is right. One test in this binary: the variable is read once per process.

mod common;

use std::time::Duration;

use remora_oncrpc::TransportChoice;
use remora_server::{EmulatedConfig, ShmConfig};

#[test]
fn long_kernels_make_the_full_call_at_once_and_short_ones_still_watch_the_word() {
    // SAFETY: set before this binary's only test makes its session, the variable's one reader.
    unsafe { std::env::set_var("REMORA_WAIT_PER_KERNEL", "1") };
    let server = common::serve_emulated(
        ShmConfig {
            enabled: true,
            data_bytes: 64 << 20,
            ..ShmConfig::default()
        },
        EmulatedConfig {
            slow_kernel: Some(("iota_u64", Duration::from_millis(2))),
            ..EmulatedConfig::default()
        },
    );
    let s = common::session(&server.endpoint, TransportChoice::Shm);
    assert_eq!(s.kernel_predicted_full_calls(), Some(0));
    let kit = common::FillKit::new(&s, 1);
    let (ctx, stream, p) = (kit.ctx, kit.stream, kit.p);
    let module = s
        .module_load(ctx, b"REMORA-EMU-MODULE\nfunc iota_u64 8,8,4\n")
        .unwrap();
    let fill = kit.function("fill_i32");
    let iota = &module.functions["iota_u64"];
    let rounds = 100;
    for v in 0..rounds {
        common::fill_i32(&s, ctx, fill, p, v, stream);
        s.stream_synchronize(ctx, stream).unwrap();
        assert_eq!(common::ints(&s, ctx, p), (v..v + 64).collect::<Vec<_>>());
        common::launch_u64s(&s, ctx, iota, stream, &[p, 1000 + v as u64, 32]);
        s.stream_synchronize(ctx, stream).unwrap();
        let got = common::ints(&s, ctx, p);
        // iota_u64 writes u64s p[i] = base + 3i: the first ints are its low and high words.
        assert_eq!(got[0], 1000 + v, "{got:?}");
        assert_eq!(got[2], 1003 + v, "{got:?}");
    }
    // Every long kernel's synchronize after the first made the full call at once (and a
    // short one may have, for a few synchronizes after one of its own took long: a busy
    // host's hiccup).
    let at_once = s.kernel_predicted_full_calls().unwrap();
    let rounds = u64::try_from(rounds).unwrap();
    assert!(at_once >= rounds - 1, "{at_once} full calls at once");
    let (seen, full) = s.signal_sync_counts().unwrap();
    assert_eq!(seen + full, 2 * rounds);
    assert!(
        seen > 0,
        "no short kernel's synchronize was seen in shared memory"
    );
}
