//! The per-kernel wait prediction (`REMORA_WAIT_PER_KERNEL=1`, an experiment) against the
//! emulated backend with one slow kernel: after the first, the long kernel's synchronizes make
//! the full call at once, the short kernel's are left to the shared waiter, and every result
//! is right. One test in this binary: the variables are read once per process.
//!
//! What the shared waiter then does with a short kernel's synchronize (spin on the word, or
//! block at once because that has lately been faster) depends on the host's load: on CI's
//! two busy cores it may rightly learn to block at once, so the test does not ask for words
//! seen. The longest word spin is 10 ms (`REMORA_WAIT_DEVICE_SPIN_US`), so "long" is over
//! 5 ms: far above a short kernel's synchronize, far below the slow kernel's 30 ms.

mod common;

use std::time::Duration;

use remora_oncrpc::TransportChoice;
use remora_server::{EmulatedConfig, ShmConfig};

#[test]
fn long_kernels_make_the_full_call_at_once_and_short_ones_are_left_to_the_shared_waiter() {
    // SAFETY: set before this binary's only test makes its session, the variables' one reader.
    unsafe {
        std::env::set_var("REMORA_WAIT_PER_KERNEL", "1");
        std::env::set_var("REMORA_WAIT_DEVICE_SPIN_US", "10000");
    }
    let server = common::serve_emulated(
        ShmConfig {
            enabled: true,
            data_bytes: 64 << 20,
            ..ShmConfig::default()
        },
        EmulatedConfig {
            slow_kernel: Some(("iota_u64", Duration::from_millis(30))),
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
    let rounds = 40;
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
    // Every long kernel's synchronize after the first made the full call at once. A short
    // one may have too, for a few synchronizes after one of its own took long (a busy host's
    // hiccup), but most were the shared waiter's to decide.
    let at_once = s.kernel_predicted_full_calls().unwrap();
    let rounds = u64::try_from(rounds).unwrap();
    assert!(at_once >= rounds - 1, "{at_once} full calls at once");
    assert!(
        at_once <= rounds + rounds / 4,
        "{at_once} of {} synchronizes made the full call at once: short kernels' too",
        2 * rounds
    );
    let (seen, full) = s.signal_sync_counts().unwrap();
    assert_eq!(seen + full, 2 * rounds, "every synchronize counted once");
    assert!(
        full >= at_once,
        "{full} full calls, {at_once} of them at once"
    );
}
